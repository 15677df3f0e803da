"""The transition account of a distributed run: every transition a collector hands to its
:class:`~conveyor.middleware.ContextExchanger` is, in the end, in the learner's replay buffer, pushed there and since
replaced by newer ones, or dropped with its reason; what none of these explains is reported as unaccounted.

- A collector (:class:`SendLedger`) counts what it offers in ``runs/<exp>/ledger/collector-<node>.json``, written
  before each send, so a SIGKILL loses no count, and read back by a restarted collector, which goes on counting:
  ``offered`` (transitions in every batch it tried to send) and ``no_learner`` (dropped: no learner was left to
  take them, the run had ended), and where its latest batches went (``sent``: the incarnation of the learner each
  was queued for, :meth:`SendLedger.sent_to`). Each batch carries ``offered_before`` (what it offered before this
  batch) and its sender's ``incarnation`` (restarts).
- The learner (:class:`TakeLedger`, saved in its checkpoints) counts what it takes into an iteration, by node. A
  batch whose ``offered_before`` is past what it counted for that node shows a gap: transitions offered that never
  reached this learner's account, dropped as ``learner_restarted`` (the first batch from the node since this
  learner resumed: taken by the killed learner after its checkpoint, or in flight when it died),
  ``sender_restarted`` (the batch comes from a new incarnation: the old one was killed with a batch it had counted
  and not sent; or, where a restarted collector never gets a batch to the learner, what its earlier lives counted
  that the learner never saw: :func:`transition_account` counts that from the collector's file) or ``lost`` (lost on
  the way, or refused on receipt: ``stats()["rejected"]``). At its end it counts the batches that arrived after its
  last iteration (``after_end``) and writes ``ledger/learner.json``.
- :func:`transition_account` puts them together (the launcher logs it where every node ran on its host). What a
  collector offered past the last batch the learner counted from it (no later batch showed the gap: the learner
  never heard from it again) is placed by where the collector's file says it went: queued for an earlier learner
  incarnation, which died before a checkpoint recorded it, ``learner_restarted``; for the learner that wrote the
  account, ``unreceived_at_end`` (in flight or lost on the way when the run ended, the sender cut off or stopped).

What stays unaccounted: a batch a collector counted and was killed before sending when the learner ended before
that collector's next life had a batch taken or counted its first; a batch whose destination its collector did not
record (killed between counting and queueing it, or queued for no learner); and what went before the oldest of
the :data:`SENT_KEPT` destinations a collector's file keeps. The account's ``by_node`` says, for each collector, how
much of it the learner never saw.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from conveyor.engine.parallel.cluster import write_text_whole

__all__ = ["DROP_REASONS", "LEDGER_DIR", "SENT_KEPT", "SendLedger", "TakeLedger", "transition_account"]

log = logging.getLogger(__name__)

LEDGER_DIR = "ledger"
"""The folder of a run directory that holds the ledgers' files."""
DROP_REASONS = ("no_learner", "sender_restarted", "learner_restarted", "lost", "after_end", "unreceived_at_end")
"""Why transitions were dropped (the module docstring says when each is counted)."""
SENT_KEPT = 8
"""How many runs of batches queued for one destination (:meth:`SendLedger.sent_to`) a collector's file keeps."""
_UNSENT, _DROPPED = "", "-"  # destinations: not recorded (yet), dropped as no_learner


def _write_json(path: Path, value: Dict[str, Any]) -> None:
    """``value`` to ``path`` as JSON, whole or not at all."""
    write_text_whole(path, json.dumps(value))


class SendLedger:
    """A collector's count of the transitions it offered (module docstring), kept in ``path``; ``resume``: go on
    from the file (a restarted collector, a resumed run) instead of starting at 0.

    The file is one fixed-size record rewritten in place (``os.pwrite`` at offset 0): a write before every send
    costs ~10 us, where a temporary file renamed over it cost ~2 ms on ext4 (its rename-over flush); a SIGKILL
    cannot interrupt the one small write, and readers read the file after its writer ended."""

    RECORD_BYTES = 1024
    """The record's size: its JSON padded with spaces (:data:`SENT_KEPT` destinations of one learner each fit)."""

    def __init__(self, path: Path, incarnation: int = 0, resume: bool = False) -> None:
        self.path, self.incarnation = Path(path), int(incarnation)
        self.offered = self.no_learner = self._last = 0
        self.sent: List[List[Any]] = []  # [destination, offered_before of its first batch], oldest first
        if resume and self.path.is_file():
            saved = json.loads(self.path.read_text())
            self.offered, self.no_learner = int(saved["offered"]), int(saved["no_learner"])
            self.sent = [[str(to), int(start)] for to, start in saved.get("sent", [])]
        self._at_start = {"offered": self.offered, "no_learner": self.no_learner}  # what earlier lives counted
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Held for the collector's life; not O_APPEND, under which Linux's pwrite ignores the offset.
        self._file = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+b", buffering=0)
        self._file.truncate(self.RECORD_BYTES)
        self._save()

    def offer(self, transitions: int) -> int:
        """Count a batch of ``transitions`` about to be sent (written before it leaves); returns ``offered_before``."""
        before, self._last = self.offered, transitions
        self.offered += transitions
        self._label(_UNSENT)
        return before

    def sent_to(self, learners: Iterable[str]) -> None:
        """The batch last offered was queued for ``learners`` (their incarnations, hex); written at once."""
        self._label(",".join(sorted(learners)) or _UNSENT)

    def drop(self) -> None:
        """The batch last offered was dropped: no learner was left to take it."""
        self.no_learner += self._last
        self._label(_DROPPED)

    def _label(self, to: str) -> None:
        """Record ``to`` as the destination of the batch last offered, and save."""
        start = self.offered - self._last
        if self.sent and self.sent[-1][1] >= start:  # the batch opened that run: relabel it
            self.sent.pop()
        if not self.sent or self.sent[-1][0] != to:
            self.sent.append([to, start])
        del self.sent[:-SENT_KEPT]
        self._save()

    def close(self) -> None:
        """Close the file (its last record stays); the ledger counts nothing after."""
        self._file.close()

    def _save(self) -> None:
        while True:  # the oldest destinations go where many learners' incarnations would not fit the record
            record = json.dumps({"offered": self.offered, "no_learner": self.no_learner, "sent": self.sent,
                                 "incarnation": self.incarnation, "at_start": self._at_start}).encode()
            if len(record) < self.RECORD_BYTES or not self.sent:
                break
            del self.sent[0]
        os.pwrite(self._file.fileno(), record.ljust(self.RECORD_BYTES - 1) + b"\n", 0)


class TakeLedger:
    """A learner's count of the transitions it took from each collector and of those it found missing, by reason
    (module docstring); ``state_dict`` / ``load_state_dict`` carry it across a resume. ``replay``: the buffer the
    taken transitions go to (its length and transitions ever added are reported with the counts). ``path``: where
    :meth:`close` writes the account at the learner's end (a file left by an earlier life is removed)."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.learner: Optional[str] = None  # this learner's incarnation (its router's, hex), as collectors record it
        self.taken: Dict[str, int] = {}
        self.counted: Dict[str, int] = {}  # by node: its offered transitions this account has placed
        self.incarnations: Dict[str, int] = {}
        self.dropped: Dict[str, int] = dict.fromkeys(DROP_REASONS[1:], 0)
        self.overlap = 0  # transitions of batches that claimed to come before what was already counted
        self.replay: Any = None
        self._resumed = False
        self._since_resume: set = set()
        self._lock = threading.Lock()

    def take(self, node: str, transitions: int, offered_before: Optional[int], incarnation: int = 0,
             after_end: bool = False) -> None:
        """Count a batch of ``transitions`` from ``node`` taken into an iteration (``after_end``: arrived after the
        last one, dropped); ``offered_before`` (None: a sender that keeps no ledger) shows what went missing
        before it."""
        with self._lock:
            if after_end:
                self.dropped["after_end"] += transitions
            else:
                self.taken[node] = self.taken.get(node, 0) + transitions
            if offered_before is not None:
                gap = offered_before - self.counted.get(node, 0)
                if gap > 0:
                    self.dropped[self._why(node, incarnation)] += gap
                elif gap < 0:
                    self.overlap -= gap
                self.counted[node] = max(self.counted.get(node, 0), offered_before) + transitions
            self.incarnations[node] = incarnation
            self._since_resume.add(node)

    def take_batch(self, batch: Dict[str, Any], after_end: bool = False) -> None:
        """:meth:`take` a batch a learner's exchanger received (``node``, ``transitions``, and from a sender that
        keeps a ledger ``offered_before`` and ``incarnation``)."""
        self.take(batch["node"], batch["transitions"], batch.get("offered_before"), batch.get("incarnation", 0),
                  after_end)

    def _why(self, node: str, incarnation: int) -> str:
        if self._resumed and node not in self._since_resume:
            return "learner_restarted"
        return "sender_restarted" if incarnation != self.incarnations.get(node, 0) else "lost"

    def close(self, after_end: Iterable[Dict[str, Any]] = ()) -> None:
        """The learner's end: count the batches that arrived after its last iteration (``after_end``, as
        :meth:`take_batch` takes them) as dropped, log the counts and write them to ``path``."""
        for batch in after_end:
            self.take_batch(batch, after_end=True)
        summary = self.summary()
        log.info("transitions taken %d (%s), dropped %s", sum(summary["taken"].values()),
                 ", ".join(f"node {node}: {n}" for node, n in sorted(summary["taken"].items())), summary["dropped"])
        if self.path is not None:
            _write_json(self.path, summary)

    def summary(self) -> Dict[str, Any]:
        """The counts, with the replay buffer's ``in_replay`` and ``replay_added`` where one is watched."""
        with self._lock:
            out = {"taken": dict(self.taken), "counted": dict(self.counted), "incarnations": dict(self.incarnations),
                   "dropped": dict(self.dropped), "overlap": self.overlap, "learner": self.learner}
        if self.replay is not None:
            out["replay"] = {"in_replay": len(self.replay), "added": int(self.replay.added)}
        return out

    def state_dict(self) -> Dict[str, Any]:
        """:meth:`summary`: what a resumed learner goes on from (the replay figures are only reported)."""
        return self.summary()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (keeping this learner's own :attr:`learner`); the next batch from each node
        that shows a gap counts it as ``learner_restarted``."""
        with self._lock:
            self.taken = {str(k): int(v) for k, v in state["taken"].items()}
            self.counted = {str(k): int(v) for k, v in state["counted"].items()}
            self.incarnations = {str(k): int(v) for k, v in state["incarnations"].items()}
            self.dropped = {**dict.fromkeys(DROP_REASONS[1:], 0), **{k: int(v) for k, v in state["dropped"].items()}}
            self.overlap = int(state["overlap"])
            self._resumed, self._since_resume = True, set()


def transition_account(run_dir: Path) -> Dict[str, Any]:
    """The run's transition account from the ledgers' files in ``run_dir`` (``ledger/``; the learner's at its end,
    else its final or latest checkpoint's): ``collected`` (offered by the collectors), ``in_replay``,
    ``replaced`` (added to the replay buffer and since replaced), ``dropped`` by reason, ``unaccounted``
    (``collected`` less all of these), ``overlap`` and ``by_node`` (each collector's file, what the learner counted
    of it, and ``not_counted``: what it sent that the learner never saw, where an unaccounted rest lies). A
    ValueError names what is missing."""
    from conveyor.middleware.ckpt import load_checkpoint

    run_dir = Path(run_dir)
    folder = run_dir / LEDGER_DIR
    learner_file = folder / "learner.json"
    if learner_file.is_file():
        learner = json.loads(learner_file.read_text())
    else:
        ckpt = next((p for p in (run_dir / "ckpt" / n for n in ("final.pth.tar", "latest.pth.tar")) if p.is_file()),
                    None)
        learner = None if ckpt is None else load_checkpoint(ckpt).get("objects", {}).get("ledger")
    if learner is None:
        raise ValueError(f"no learner ledger in {run_dir} (ledger/learner.json, or a checkpoint holding one): is it "
                         f"the directory of a distributed run?")
    senders = {p.stem.split("-", 1)[1]: json.loads(p.read_text()) for p in sorted(folder.glob("collector-*.json"))}
    dropped = {reason: int(learner["dropped"].get(reason, 0)) for reason in DROP_REASONS[1:]}
    dropped["no_learner"] = sum(s["no_learner"] for s in senders.values())
    collected = sum(s["offered"] for s in senders.values())
    replay = learner.get("replay") or {"in_replay": 0, "added": sum(learner["taken"].values())}
    for node, s in senders.items():
        counted = learner["counted"].get(node, 0)
        seen = learner["incarnations"].get(node)
        # A collector killed, restarted, and never heard from again: what its earlier lives counted and the learner
        # never saw died with them.
        if s["incarnation"] > 0 and (seen is None or seen < s["incarnation"]):
            earlier = s["at_start"]["offered"] - s["at_start"]["no_learner"] - counted
            dropped["sender_restarted"] += max(0, earlier)
            counted = max(counted, s["at_start"]["offered"])
        for reason, n in _unseen(s.get("sent", []), counted, s["offered"], learner.get("learner")).items():
            dropped[reason] += n
    placed = replay["added"] + sum(dropped.values())
    by_node = {node: {"offered": s["offered"], "no_learner": s["no_learner"], "incarnation": s["incarnation"],
                      "taken": learner["taken"].get(node, 0), "counted": learner["counted"].get(node, 0),
                      "last_seen_incarnation": learner["incarnations"].get(node),
                      "not_counted": s["offered"] - s["no_learner"] - learner["counted"].get(node, 0)}
               for node, s in senders.items()}
    return {"collected": collected, "in_replay": replay["in_replay"], "replaced": replay["added"] - replay["in_replay"],
            "taken": sum(learner["taken"].values()), "dropped": dropped, "unaccounted": collected - placed,
            "overlap": int(learner["overlap"]), "by_node": by_node}


def _unseen(sent: List[List[Any]], start: int, end: int, learner: Optional[str]) -> Dict[str, int]:
    """What a collector offered from ``start`` to ``end`` (its transitions past what the learner counted), by where
    it went (``sent``: :attr:`SendLedger.sent`): queued for ``learner``, the one that wrote the account,
    ``unreceived_at_end``; for another learner incarnation, ``learner_restarted``; undocumented or dropped: not here."""
    out = dict.fromkeys(("learner_restarted", "unreceived_at_end"), 0)
    for (to, first), (_, after) in zip(sent, sent[1:] + [[None, end]]):
        n = min(after, end) - max(first, start)
        if n > 0 and learner and to not in (_UNSENT, _DROPPED):
            out["unreceived_at_end" if to == learner else "learner_restarted"] += n
    return out
