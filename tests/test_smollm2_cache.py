"""The converted smollm2 cache: an interrupted conversion leaves nothing; a half-written folder is redone."""

import pytest

from dflow_trt.targets import smollm2


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def boom(src, dst):
        (dst / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert", boom)
    with pytest.raises(KeyboardInterrupt):
        smollm2.ensure_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the cache nor the temp folder survives


@pytest.mark.slow
def test_half_written_cache_is_not_trusted(tmp_path):
    bad = tmp_path / smollm2.CACHE_SUBDIR
    bad.mkdir()
    (bad / "config.json").write_text("{not json")  # no COMPLETE marker: an earlier crash
    out = smollm2.ensure_checkpoint(tmp_path)
    assert out == bad and (out / "COMPLETE").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert [p.name for p in tmp_path.iterdir()] == [smollm2.CACHE_SUBDIR]
