"""Issue 30's first two promises: a command deletes nothing it did not write and validates before it
touches the disk; artefacts never run code when loaded."""

import os
import pickle
from pathlib import Path

import pytest

from conftest import run_cli
from dflow_trt.atomic import TMP_MARK, atomic_dir, claim_dir, write_text
from dflow_trt.errors import UserError


def _plant_user_files(root: Path) -> dict[Path, str]:
    files = {root / ".my-notes" / "n.txt": "notes", root / "sub" / ".node-cache" / "c.txt": "cache",
             root / "keep.md": "mine"}
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return files


def _one_error_line(r) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("earlier_build", [True, False])
def test_build_refuses_before_touching_user_files(tmp_path, earlier_build):
    """`build --target no-such-target --out O` over an earlier build, or any build into a folder of
    someone else's files, exits 2 and leaves every file as it was (it used to remove O/.my-notes
    and O/sub/.node-cache before checking anything)."""
    files = _plant_user_files(tmp_path)
    if earlier_build:
        (tmp_path / ".stages").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    target = "no-such-target" if earlier_build else "tiny-qwen3"
    line = _one_error_line(run_cli("build", "--target", target, "--out", str(tmp_path), timeout=300))
    assert ("unknown target 'no-such-target'" if earlier_build else "holds files that are not a dflow_trt build") in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert all(p.read_text() == text for p, text in files.items())


def test_build_unknown_target_creates_nothing(tmp_path):
    out = tmp_path / "new"
    _one_error_line(run_cli("build", "--target", "no-such-target", "--out", str(out)))
    assert not out.exists()


def test_claim_dir_rules(tmp_path):
    assert claim_dir(tmp_path / "new", "build", own=(".stages",)) == tmp_path / "new"  # new: fine, not created
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    claim_dir(tmp_path / "empty", "build", own=(".stages",))
    (tmp_path / "ours" / ".stages").mkdir(parents=True)
    (tmp_path / "ours" / "x").write_text("")
    claim_dir(tmp_path / "ours", "build", own=(".stages",))
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a.txt").write_text("")
    with pytest.raises(UserError, match="not a build"):
        claim_dir(tmp_path / "theirs", "build", own=(".stages",))
    with pytest.raises(UserError, match="is a file"):
        claim_dir(tmp_path / "theirs" / "a.txt", "build", own=(".stages",))
    with pytest.raises(UserError, match="is a file"):
        claim_dir(tmp_path / "theirs" / "a.txt" / "sub", "build", own=(".stages",))


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path):
    dest = tmp_path / "art"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
    assert (dest / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (dest / "a").read_text() == "1"  # the old artefact stands; the temporary is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    # a temporary a killed process left is swept when the same artefact is written again, a look-alike is not
    (tmp_path / f".art{TMP_MARK}dead").mkdir()
    (tmp_path / ".art-notes").mkdir()
    with atomic_dir(dest) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art-notes", "art"]
    assert [p.name for p in dest.iterdir()] == ["b"]
    write_text(tmp_path / "f.json", "{}")
    assert (tmp_path / "f.json").read_text() == "{}" and not list(tmp_path.glob(f"*{TMP_MARK}*"))


class _Planted:
    """What an attacker would pickle into checkpoint.pt: code that runs on unpickling."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_checkpoint_runs_no_code(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    marker = tmp_path / "pwned"
    with open(out / "checkpoint.pt", "wb") as f:
        pickle.dump({"step": _Planted(str(marker))}, f)
    r = run_cli("train", "--target", "tiny-qwen3", "--data-dir", str(tmp_path / "no-data"), "--out-dir", str(out),
                "--steps", "2", timeout=300)
    # refused either for the missing data or for the checkpoint; in no order may the pickle run
    _one_error_line(r)
    assert not marker.exists()
    from dflow_trt.training.trainer import _load_ckpt

    with pytest.raises(UserError, match="not a readable dflow_trt checkpoint"):
        _load_ckpt(out / "checkpoint.pt")
    assert not marker.exists()


def test_checkpoint_without_training_state_is_refused(tmp_path):
    import torch

    from dflow_trt.training.trainer import _load_ckpt

    torch.save({"step": 3}, tmp_path / "checkpoint.pt")
    with pytest.raises(UserError, match="lacks the training state"):
        _load_ckpt(tmp_path / "checkpoint.pt")


def test_target_folder_with_a_pickled_bin_runs_no_code(tmp_path):
    """A checkpoint folder whose weights are a pickle (pytorch_model.bin) is refused: targets load
    from safetensors only, so code planted in the pickle never runs."""
    from dflow_trt.targets import load_target
    from dflow_trt.targets.tiny import build_tiny

    model, _ = build_tiny("qwen3")
    model.config.save_pretrained(tmp_path)
    marker = tmp_path / "pwned"
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Planted(str(marker))}, f)
    with pytest.raises(UserError, match=f"cannot load the model in {tmp_path}"):
        load_target(str(tmp_path))
    assert not marker.exists()
