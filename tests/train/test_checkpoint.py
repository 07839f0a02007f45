import json

import pytest
import torch

from aftlab.errors import UsageError
from aftlab.train.checkpoint import (
    RunLock,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied, as in the language model


def _save(run, step, model, keep_last=2):
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(
        run,
        step=step,
        model=model,
        config={"train": {"x": step}},
        train_state={"step": step, "optimizer": opt.state_dict(), "rng": rng_state()},
        keep_last=keep_last,
    )


def test_round_trip_with_tied_weights_and_keep_last(tmp_path):
    model = Tied()
    for step in (1, 2, 3):
        path = _save(tmp_path, step, model)
    assert path.name == "step_00000003" and latest_checkpoint(tmp_path) == path
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]  # keep_last=2
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 3 and set(manifest["files"]) == {
        "model.safetensors",
        "config.json",
        "train_state.safetensors",
        "train_state.json",
    }
    other = Tied()
    state = load_checkpoint(path, other)
    assert state["step"] == 3 and load_checkpoint(path, other, with_state=False) == {"step": 3}
    assert torch.equal(other.emb.weight, model.emb.weight) and other.head.weight is other.emb.weight


def test_stale_temporary_folder_is_ignored_and_removed_under_the_lock(tmp_path):
    model = Tied()
    _save(tmp_path, 1, model)
    stale = tmp_path / "checkpoints" / ".tmp-step_00000002-999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")  # what a kill during a save leaves
    stale_file = tmp_path / ".tmp-config.toml-999"
    stale_file.write_text("half")
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    _save(tmp_path, 2, model)
    assert stale.exists()  # a save never touches another writer's files
    with RunLock(tmp_path) as lock:
        lock.remove_stale_temporaries()  # under the lock, no other writer is alive
    assert not stale.exists() and not stale_file.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_checkpoint_is_detected(tmp_path, damage):
    path = _save(tmp_path, 1, Tied())
    f = path / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        f.unlink()
    else:
        (path / "manifest.json").write_text("{")
    with pytest.raises(UsageError, match="checkpoint .*(damaged|missing|manifest)"):
        load_checkpoint(path, Tied())


def test_config_edit_is_detected(tmp_path):
    path = _save(tmp_path, 1, Tied())
    cfg = json.loads((path / "config.json").read_text())
    cfg["train"]["x"] = 99
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="config.json does not match its sha256"):
        verify_checkpoint(path)


def test_weights_that_do_not_fit_the_model(tmp_path):
    path = _save(tmp_path, 1, Tied())
    with pytest.raises(UsageError, match="does not match the model built from the config"):
        load_checkpoint(path, torch.nn.Linear(2, 2))


def test_rng_state_round_trip():
    state = rng_state()
    a = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    set_rng_state(state)
    b = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_carried_state_is_checked_like_every_file_of_the_checkpoint(tmp_path):
    from aftlab.train.checkpoint import load_carried_state

    model = Tied()
    carried = ({"states.0.a": torch.randn(2, 3), "states.0.valid": torch.ones(2, 1).bool()},
               {"position": 7, "batch_size": 2, "states.0.position": 7})  # fmt: skip
    opt = torch.optim.AdamW(model.parameters())
    state = {"step": 1, "optimizer": opt.state_dict(), "rng": rng_state()}
    path = save_checkpoint(
        tmp_path, step=1, model=model, config={}, train_state=state, keep_last=2, carried=carried
    )
    assert "carried_state.safetensors" in verify_checkpoint(path)["files"]
    tensors, values = load_carried_state(path)
    assert values == carried[1] and tensors.keys() == carried[0].keys()
    assert all(torch.equal(tensors[k], carried[0][k]) for k in tensors)
    data = bytearray((path / "carried_state.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "carried_state.safetensors").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="carried_state.safetensors does not match its sha256"):
        verify_checkpoint(path)
    plain = _save(tmp_path / "plain", 1, model)  # no carried state: none may be planted
    assert load_carried_state(plain) is None
    (plain / "carried_state.safetensors").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="carried_state.safetensors is not in manifest.json"):
        verify_checkpoint(plain)
