"""Kept: what ``keep`` carries over, an explicit object shared by the contexts of one task."""
import copy
import pickle

from conveyor import OnlineRLContext, task
from conveyor.engine.context import Kept


def test_a_kept_field_written_in_one_context_is_written_in_every_context_sharing_it():
    kept = Kept.of(OnlineRLContext())
    a, b = kept.context(OnlineRLContext), kept.context(OnlineRLContext)
    a.env_step, a.obs = 5, "mine"
    assert (b.env_step, b.obs) == (5, None) and kept.values["env_step"] == 5


def test_carry_gives_an_independent_context():
    ctx = OnlineRLContext()
    ctx.env_step = 3
    other = Kept.of(ctx).context(OnlineRLContext, carry=True)
    other.env_step = 9
    assert (ctx.env_step, other.env_step) == (3, 9)


def test_rollback_returns_to_what_committed_contexts_wrote():
    kept = Kept.of(OnlineRLContext())
    kept.commit()
    done, failed = kept.context(OnlineRLContext), kept.context(OnlineRLContext)
    done.env_step = 4
    failed.env_step, failed.train_iter = 8, 2
    kept.commit(done)
    kept.rollback()
    assert (done.env_step, done.train_iter, failed.env_step) == (4, 0, 4)


def test_the_task_s_contexts_share_the_kept_of_the_start_context():
    start = OnlineRLContext()
    with task.start(ctx=start):
        task.use(lambda ctx: setattr(ctx, "env_step", ctx.env_step + 1))
        task.run(max_step=2)
        assert Kept.of(task.ctx) is Kept.of(start) and start.env_step == 2


def test_a_copied_or_unpickled_context_keeps_its_values_and_shares_nothing():
    ctx = OnlineRLContext()
    ctx.env_step = 7
    for other in (copy.deepcopy(ctx), pickle.loads(pickle.dumps(ctx))):
        other.env_step += 1
        assert (other.env_step, other.kept_fields, ctx.env_step) == (8, ctx.kept_fields, 7)
