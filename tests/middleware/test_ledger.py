"""The transition account (conveyor/middleware/ledger.py): every transition a collector offers is taken by the
learner or dropped with its reason, across collector restarts and learner resumes."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conveyor.data import DequeBuffer
from conveyor.middleware.ledger import LEDGER_DIR, SENT_KEPT, SendLedger, TakeLedger, transition_account

ROOT = Path(__file__).resolve().parents[2]


def sender(run_dir, node, incarnation=0):
    return SendLedger(run_dir / LEDGER_DIR / f"collector-{node}.json", incarnation, resume=incarnation > 0)


def send(collector, learner, node, n, taken=True):
    """One batch of ``n`` transitions offered by ``collector`` and queued for ``learner`` (where it has an
    incarnation); taken by it unless ``taken`` is False."""
    before = collector.offer(n)
    if learner.learner is not None:
        collector.sent_to([learner.learner])
    if taken:
        learner.take(node, n, before, collector.incarnation)


def learner_life(incarnation, checkpoint=None):
    """A learner whose router's incarnation is ``incarnation``, resumed from ``checkpoint`` if given."""
    learner = TakeLedger()
    learner.learner = incarnation
    if checkpoint is not None:
        learner.load_state_dict(json.loads(json.dumps(checkpoint)))
    return learner


def finish(run_dir, learner):
    learner.path = run_dir / LEDGER_DIR / "learner.json"
    learner.close()
    return transition_account(run_dir)


def test_a_batch_its_killed_collector_counted_and_never_sent_is_dropped_as_sender_restarted(tmp_path):
    learner, first = TakeLedger(), sender(tmp_path, 1)
    send(first, learner, "1", 8)
    send(first, learner, "1", 5, taken=False)  # counted in its file, then SIGKILL before the send
    restarted = sender(tmp_path, 1, incarnation=1)  # goes on from the file
    send(restarted, learner, "1", 8)
    account = finish(tmp_path, learner)
    assert restarted.offered == 21 and learner.dropped["sender_restarted"] == 5
    assert account["collected"] == 21 and account["taken"] == 16 and account["unaccounted"] == 0


def test_what_a_killed_collector_counted_is_dropped_as_sender_restarted_when_its_next_life_never_reaches_the_learner(
        tmp_path):
    learner, first = TakeLedger(), sender(tmp_path, 1)
    send(first, learner, "1", 8)
    send(first, learner, "1", 5, taken=False)  # counted in its file, then SIGKILL before the send
    restarted = sender(tmp_path, 1, incarnation=1)
    send(restarted, learner, "1", 3, taken=False)  # in flight when the learner ended: nothing can count it
    account = finish(tmp_path, learner)
    assert account["dropped"]["sender_restarted"] == 5 and account["unaccounted"] == 3
    assert account["by_node"]["1"]["not_counted"] == 8


def test_a_batch_lost_between_live_peers_is_dropped_as_lost_and_one_with_no_learner_as_no_learner(tmp_path):
    learner, collector = TakeLedger(), sender(tmp_path, 1)
    send(collector, learner, "1", 4)
    send(collector, learner, "1", 4, taken=False)  # never arrived: the next batch shows the gap
    send(collector, learner, "1", 4)
    collector.offer(3)
    collector.drop()  # no learner left to take it
    account = finish(tmp_path, learner)
    assert account["dropped"]["lost"] == 4 and account["dropped"]["no_learner"] == 3
    assert account["collected"] == 15 and account["unaccounted"] == 0


def test_counts_survive_a_learner_resume_and_what_the_killed_learner_took_after_its_checkpoint_is_dropped(tmp_path):
    learner, collector = TakeLedger(), sender(tmp_path, 1)
    send(collector, learner, "1", 6)
    checkpoint = json.loads(json.dumps(learner.state_dict()))  # what its checkpoint holds
    send(collector, learner, "1", 6)  # taken by the learner after its checkpoint; then SIGKILL
    resumed = TakeLedger()
    resumed.load_state_dict(checkpoint)
    assert resumed.taken == {"1": 6}
    send(collector, resumed, "1", 6)
    send(collector, resumed, "1", 2, taken=False)  # after the resume, a gap is a loss again
    send(collector, resumed, "1", 6)
    account = finish(tmp_path, resumed)
    assert account["dropped"]["learner_restarted"] == 6 and account["dropped"]["lost"] == 2
    assert account["taken"] == 18 and account["collected"] == 26 and account["unaccounted"] == 0


def test_the_account_reports_the_replay_buffer_and_what_it_cannot_explain(tmp_path):
    learner, collector = TakeLedger(), sender(tmp_path, 1)
    learner.replay = buffer = DequeBuffer(4)
    send(collector, learner, "1", 3)
    buffer.extend({"reward": [0.0, 1.0, 2.0]})
    send(collector, learner, "1", 3)
    buffer.extend({"reward": [0.0, 1.0, 2.0]})
    learner.take("1", 2, collector.offer(2), after_end=True)  # arrived after the learner's last iteration
    collector.offer(5)  # in flight when the learner ended, never received: nothing counts it
    account = finish(tmp_path, learner)
    assert (account["in_replay"], account["replaced"]) == (4, 2) and account["dropped"]["after_end"] == 2
    assert account["collected"] == 13 and account["unaccounted"] == 5 and account["by_node"]["1"]["not_counted"] == 5


def test_a_collector_never_heard_from_again_is_placed_by_the_learner_its_batches_were_queued_for(
        tmp_path):
    first, steady, cut_off = learner_life("aa"), sender(tmp_path, 1), sender(tmp_path, 2)
    send(steady, first, "1", 4)
    checkpoint = first.state_dict()  # before any batch of collector 2
    send(cut_off, first, "2", 6)
    send(cut_off, first, "2", 6, taken=False)  # queued for the first learner, in flight when it was killed
    resumed = learner_life("bb", checkpoint)
    send(steady, resumed, "1", 4)
    send(cut_off, resumed, "2", 5, taken=False)  # cut off from here to the run's end: never received
    account = finish(tmp_path, resumed)
    assert account["dropped"]["learner_restarted"] == 12 and account["dropped"]["unreceived_at_end"] == 5
    assert account["collected"] == 25 and account["unaccounted"] == 0
    assert account["by_node"]["2"]["not_counted"] == 17


def test_what_a_collector_queued_for_no_known_learner_past_the_learners_count_stays_unaccounted(tmp_path):
    learner, collector = learner_life("aa"), sender(tmp_path, 1)
    send(collector, learner, "1", 4)
    collector.offer(3)  # killed between counting it and queueing it: its destination is not in the file
    collector.sent_to([])  # or queued for no learner
    collector.offer(2)
    collector.sent_to(["cc"])  # queued for a learner incarnation, then SIGKILL before the next one started
    account = finish(tmp_path, learner)
    assert account["dropped"]["learner_restarted"] == 2 and account["dropped"]["unreceived_at_end"] == 0
    assert account["unaccounted"] == 3


def test_a_collector_file_keeps_its_latest_destinations_and_a_restart_goes_on_from_them(tmp_path):
    collector = sender(tmp_path, 1)
    for learner in range(SENT_KEPT + 2):
        collector.offer(1)
        collector.sent_to([f"{learner:02x}"])
        collector.offer(1)
        collector.sent_to([f"{learner:02x}"])  # the same destination: one run of batches
    collector.offer(3)
    collector.drop()
    restarted = sender(tmp_path, 1, incarnation=1)
    assert restarted.sent[0] == ["03", 6] and restarted.sent[-1] == ["-", 20] and len(restarted.sent) == SENT_KEPT


def test_destinations_that_would_not_fit_the_record_drop_the_oldest_and_the_file_reads_back(tmp_path):
    collector = sender(tmp_path, 1)
    for turn in range(SENT_KEPT):  # a batch queued for five learners: five incarnations in each destination
        collector.offer(1)
        collector.sent_to([f"{turn:02x}{learner:030x}" for learner in range(5)])
    collector.close()
    restarted = sender(tmp_path, 1, incarnation=1)
    assert restarted.offered == SENT_KEPT and 0 < len(restarted.sent) < SENT_KEPT
    assert restarted.sent[-1][1] == SENT_KEPT - 1


def test_a_sigkilled_collector_loses_no_count_and_its_restart_goes_on_from_its_file(tmp_path):
    """The collector's file is rewritten in place before each send: killed right after an offer, its next life
    reads every batch counted."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom conveyor.middleware.ledger import SendLedger\n"
         f"ledger = SendLedger(Path({str(tmp_path / 'collector-1.json')!r}))\n"
         "for _ in range(3):\n    print(ledger.offer(8) + 8, flush=True)\n    sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "8"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "16"  # it waits on stdin: between two offers
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        child.kill()
    restarted = SendLedger(tmp_path / "collector-1.json", incarnation=1, resume=True)
    assert restarted.offered == 16 and json.loads((tmp_path / "collector-1.json").read_text())["incarnation"] == 1
    restarted.offer(4)
    restarted.close()
    assert json.loads((tmp_path / "collector-1.json").read_text())["offered"] == 20
