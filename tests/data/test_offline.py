"""Offline datasets: Minari and transitions files round trip exactly; bad files and spaces are clear errors."""
import gymnasium as gym
import h5py
import numpy as np
import pytest

from conveyor.data import (DatasetError, DatasetWriter, OfflineDataset, check_spaces, concat_datasets,
                           dataset_metadata, load_dataset, save_dataset)

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT = gym.spaces.Discrete(2)
FIELDS = ("observations", "actions", "rewards", "next_observations", "terminations", "truncations", "episode_ids")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def episodes(lengths=(5, 7, 3), seed=0):
    """Episodes as collectors hand them out; the second is truncated, the others terminated."""
    rng = np.random.default_rng(seed)
    out = []
    for k, n in enumerate(lengths):
        o = rng.uniform(-1, 1, (n + 1, 3)).astype(np.float32)
        end, never = np.eye(n, dtype=bool)[-1], np.zeros(n, bool)
        out.append(dict(obs=o[:-1], next_obs=o[1:], action=rng.integers(0, 2, n), reward=rng.random(n),
                        terminated=never if k == 1 else end, truncated=end if k == 1 else never))
    return out


def recorded(tmp_path, dataset_id="test/tiny-v0"):
    with DatasetWriter(dataset_id, OBS, ACT, root=tmp_path) as writer:
        for ep in episodes():
            writer.add_episode(ep)
    return load_dataset(dataset_id, root=tmp_path)


def assert_same(a: OfflineDataset, b: OfflineDataset):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.observation_space == b.observation_space and a.action_space == b.action_space


def test_minari_round_trip_keeps_every_transition_and_both_spaces(tmp_path):
    data = recorded(tmp_path)
    eps = episodes()
    assert len(data) == 15 and data.num_episodes == 3
    assert np.array_equal(data.observations, np.concatenate([e["obs"] for e in eps]))
    assert np.array_equal(data.next_observations, np.concatenate([e["next_obs"] for e in eps]))
    assert np.array_equal(data.actions, np.concatenate([e["action"] for e in eps]))
    assert np.array_equal(data.rewards, np.concatenate([e["reward"] for e in eps]).astype(np.float32))
    assert (data.observation_space, data.action_space) == (OBS, ACT)


def test_terminated_and_truncated_stay_distinct(tmp_path):
    data = recorded(tmp_path)
    assert np.flatnonzero(data.terminations).tolist() == [4, 14]
    assert np.flatnonzero(data.truncations).tolist() == [11]
    assert data.episode_ids.tolist() == [0] * 5 + [1] * 7 + [2] * 3


def test_minari_itself_reads_what_the_writer_wrote(tmp_path, monkeypatch):
    import minari
    recorded(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    dataset = minari.load_dataset("test/tiny-v0")
    assert (dataset.total_episodes, dataset.total_steps) == (3, 15)
    assert_same(load_dataset("test/tiny-v0"), load_dataset(tmp_path / "test" / "tiny-v0"))


def test_metadata_a_writer_adds_is_kept_and_minari_reads_its_reference_scores(tmp_path, monkeypatch):
    import minari
    with DatasetWriter("test/meta-v0", OBS, ACT, root=tmp_path,
                       metadata={"ref_min_score": -10.0, "ref_max_score": 10.0}) as writer:
        writer.add_episode(episodes()[0])
        writer.update_metadata({"run": {"seed": 3, "config": {"env": {"env_id": "X"}}}})
        with pytest.raises(ValueError, match="Minari's own keys"):
            writer.update_metadata({"total_steps": 1})
    metadata = dataset_metadata("test/meta-v0", root=tmp_path)
    assert metadata["run"] == {"seed": 3, "config": {"env": {"env_id": "X"}}} and metadata["total_steps"] == 5
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    assert minari.get_normalized_score(minari.load_dataset("test/meta-v0"), np.array([0.0])) == pytest.approx(0.5)
    with pytest.raises(FileNotFoundError, match="no Minari dataset 'test/none-v0'"):
        dataset_metadata("test/none-v0", root=tmp_path)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_transitions_file_round_trip(tmp_path, suffix):
    data = recorded(tmp_path)
    path = save_dataset(data, tmp_path / f"tiny{suffix}")
    assert_same(load_dataset(path), data)


def test_writer_refuses_an_existing_id_and_a_malformed_one(tmp_path):
    recorded(tmp_path)
    with pytest.raises(FileExistsError, match="exists already"):
        DatasetWriter("test/tiny-v0", OBS, ACT, root=tmp_path)
    with pytest.raises(DatasetError, match="not a Minari id"):
        DatasetWriter("no version", OBS, ACT, root=tmp_path)


def test_writer_refuses_an_episode_that_is_not_one_continuous_run(tmp_path):
    ep = episodes()[0]
    ep["next_obs"] = ep["next_obs"].copy()
    ep["next_obs"][2] += 1.0
    with DatasetWriter("test/bad-v0", OBS, ACT, root=tmp_path) as writer:
        with pytest.raises(DatasetError, match=r"obs\[3\] differs from its next_obs\[2\]"):
            writer.add_episode(ep)


def test_space_mismatch_error_shows_both_spaces(tmp_path):
    data = recorded(tmp_path)
    other = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    with pytest.raises(DatasetError) as err:
        check_spaces(data, other, ACT)
    assert str(OBS) in str(err.value) and str(other) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DatasetError, match=r"action space Discrete\(2\) .* Discrete\(3\)"):
        check_spaces(data, OBS, gym.spaces.Discrete(3))
    check_spaces(data, OBS, ACT)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_truncated_file_is_a_one_line_error_naming_it(tmp_path, suffix):
    path = save_dataset(recorded(tmp_path), tmp_path / f"tiny{suffix}")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DatasetError, match="corrupt or truncated") as err:
        load_dataset(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_truncated_minari_dataset_is_a_one_line_error_naming_it(tmp_path):
    recorded(tmp_path)
    main = tmp_path / "test" / "tiny-v0" / "data" / "main_data.hdf5"
    main.write_bytes(main.read_bytes()[:1000])
    with pytest.raises(DatasetError, match="cannot read Minari dataset") as err:
        load_dataset("test/tiny-v0", root=tmp_path)
    assert str(main.parent) in str(err.value) and "\n" not in str(err.value)


def test_missing_array_and_missing_dataset_are_named(tmp_path):
    np.savez(tmp_path / "partial.npz", observations=np.zeros((3, 3), np.float32))
    with pytest.raises(DatasetError, match=r"partial.npz has no 'actions' array \(it holds: observations\)"):
        load_dataset(tmp_path / "partial.npz", observation_space=OBS, action_space=ACT)
    with pytest.raises(FileNotFoundError, match="no Minari dataset 'test/absent-v0'"):
        load_dataset("test/absent-v0", root=tmp_path)


def test_d4rl_style_hdf5_without_spaces_loads_with_spaces_given(tmp_path):
    n = 4
    with h5py.File(tmp_path / "d4rl.hdf5", "w") as f:
        f["observations"] = np.zeros((n, 3), np.float32)
        f["next_observations"] = np.ones((n, 3), np.float32)
        f["actions"] = np.array([0, 1, 1, 0])
        f["rewards"] = np.ones(n)
        f["terminals"] = np.array([0, 1, 0, 0], bool)
        f["timeouts"] = np.array([0, 0, 0, 1], bool)
    with pytest.raises(DatasetError, match="stores no observation_space"):
        load_dataset(tmp_path / "d4rl.hdf5")
    data = load_dataset(tmp_path / "d4rl.hdf5", observation_space=OBS, action_space=ACT)
    assert data.episode_ids.tolist() == [0, 0, 1, 1] and data.truncations.tolist() == [False, False, False, True]
    assert data.episode_returns().tolist() == [2.0, 2.0]


def test_rows_of_different_lengths_are_refused(tmp_path):
    data = recorded(tmp_path)
    with pytest.raises(DatasetError, match="'actions' has 14 rows but 'rewards' has 15"):
        OfflineDataset(data.observations, data.actions[:-1], data.rewards, data.next_observations,
                       data.terminations, data.truncations, OBS, ACT)


def test_concatenated_datasets_keep_their_episodes_apart(tmp_path):
    data = recorded(tmp_path)
    both = concat_datasets([data, data.slice(5, 12)])
    assert len(both) == 22 and both.num_episodes == 4
    assert both.episode_returns()[-1] == pytest.approx(data.episode_returns()[1])
    other = OfflineDataset(data.observations, data.actions, data.rewards, data.next_observations, data.terminations,
                           data.truncations, OBS, gym.spaces.Discrete(3))
    with pytest.raises(DatasetError, match=r"action space Discrete\(3\)"):
        concat_datasets([data, other])


def test_dict_observations_round_trip_through_minari_and_the_fetcher(tmp_path):
    from easydict import EasyDict

    from conveyor.middleware import offline_data_fetcher
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32), "vel": gym.spaces.Box(-1, 1, (1,), np.float32)})
    rng = np.random.default_rng(0)
    obs = {"pos": rng.uniform(-1, 1, (7, 2)).astype(np.float32), "vel": rng.uniform(-1, 1, (7, 1)).astype(np.float32)}
    episode = dict(obs={k: v[:-1] for k, v in obs.items()}, next_obs={k: v[1:] for k, v in obs.items()},
                   action=np.arange(6) % 2, reward=np.ones(6), terminated=np.eye(6, dtype=bool)[-1],
                   truncated=np.zeros(6, bool))
    with DatasetWriter("test/dict-v0", space, ACT, root=tmp_path) as writer:
        writer.add_episode(episode)
    data = load_dataset("test/dict-v0", root=tmp_path)
    assert data.observation_space == space
    assert np.array_equal(data.next_observations["vel"], obs["vel"][1:])
    batch = offline_data_fetcher(EasyDict(seed=0, policy=dict(learn=dict(batch_size=4))), data).next_batch()
    assert np.array_equal(batch.obs.pos.numpy(), obs["pos"][batch.index.numpy()])


def test_a_file_that_is_no_archive_is_a_clear_error(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not numpy at all")
    with pytest.raises(DatasetError, match=r"junk.npz: corrupt or truncated .npz file \(not a zip archive\)"):
        load_dataset(tmp_path / "junk.npz")
