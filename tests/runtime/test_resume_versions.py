"""Which older weight versions a resumed run gives its engines (`Driver._older_weights`): those of kept
checkpoints, version 0 of the first policy from the engines' own model, another full-model policy's
version 0 from the model's path, and a restart under the resumed version for the rest. Checked on the
books alone, without processes."""

from pathlib import Path
from types import SimpleNamespace

from tailrace.runtime.driver import Driver


class Books:
    """The scheduler calls `_older_weights` makes, recorded."""

    def __init__(self, pending: set[int], versions_at_once=None):
        self.pending, self.restored, self.restarted = pending, [], []
        self.capabilities = SimpleNamespace(versions_at_once=versions_at_once)

    def pending_versions(self):
        return set(self.pending)

    def restore_version(self, v):
        self.restored.append(v)

    def restart_groups(self, versions, version):
        self.restarted.append((sorted(versions), version))
        return len(versions)


def older(pending, index=0, saved=None, versions_at_once=None, resumed=3, lora=0):
    books = Books(pending, versions_at_once)
    pol = SimpleNamespace(
        sched=books, index=index, saved_versions=saved or {}, ses=SimpleNamespace(model_path="/models/m"),
        train_cfg=SimpleNamespace(lora=SimpleNamespace(rank=lora)),
    )  # fmt: skip
    run = SimpleNamespace(ui=None, sched=SimpleNamespace(version=lambda p, v: 100 * p + v))
    return Driver._older_weights(run, pol, resumed), books


def test_version_0_of_the_first_policy_is_the_engines_own_model(tmp_path):
    """A multiversion checkpoint whose open groups of version 0 still have samples to do: kept, not
    restarted (a resume used to wait for version 0 forever: no engine held it)."""
    disk, books = older({0, 3})
    assert books.restored == [0] and books.restarted == [] and disk == {}


def test_a_kept_checkpoints_version_comes_from_disk_and_a_pruned_ones_groups_restart(tmp_path):
    (tmp_path / "step_2").mkdir()
    disk, books = older({1, 2, 3}, saved={2: tmp_path / "step_2"})
    assert books.restored == [2] and books.restarted == [([1], 3)]
    assert disk == {2: Path(tmp_path / "step_2" / "model")}


def test_another_policys_version_0_is_loaded_from_the_models_path():
    """Its engine version is not 0, so no engine holds it as its own model; it is the model the run
    started from all the same (policies share model.path): loaded from there, its groups kept."""
    disk, books = older({0, 2}, index=1)
    assert books.restored == [0] and books.restarted == [([2], 3)]
    assert disk == {100: Path("/models/m")}


def test_a_lora_policys_version_0_and_one_version_engines_restart():
    _, books = older({0}, index=1, lora=8)  # its start adapter is in no file
    assert books.restored == [] and books.restarted == [([0], 3)]
    _, books = older({0, 2}, versions_at_once=1)
    assert books.restored == [] and books.restarted == [([0, 2], 3)]
