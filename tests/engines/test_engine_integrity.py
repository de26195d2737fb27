"""Engine directories are verified against manifest.json when they load: a damaged file is
refused naming it (missing / size / content), sha256 runs on the first load and again only for a
file whose stat changed, and every file error at load names the file."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tandem.engines import integrity
from tandem.engines.manifest import ManifestError, file_sha256, read_manifest, signed
from tandem.pipeline.llm import LLM
from tandem.server.chat_template import ChatTemplate, ChatTemplateError

REBUILD = "tandem build-engines MODEL_DIR --out"


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch) -> Path:
    """The per-user cache goes to the test's folder, never to ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def engines(engine_dirs, tmp_path) -> Path:
    """A private copy of a session engine dir (the session's own is never modified)."""
    path = tmp_path / "engines"
    shutil.copytree(engine_dirs["qwen3_5_mtp3"], path)
    return path


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """Names of the files hashed by the load-time check, in call order."""
    calls = []

    def counting(path):
        calls.append(Path(path).name)
        return file_sha256(path)

    monkeypatch.setattr(integrity, "file_sha256", counting)
    return calls


def prime(path: Path) -> None:
    """What a first load does before anything else reads the files: verify, and cache the result."""
    assert integrity.verify_engine_dir(path, read_manifest(path)).hashed


def test_second_load_of_an_intact_dir_does_not_hash_again(engines, hashes):
    first = LLM(engines)
    named = set(read_manifest(engines)["files"])
    assert sorted(hashes) == sorted(named) and first.verification.cache == engines / integrity.CACHE_FILE
    second = LLM(engines)
    assert len(hashes) == len(named) and second.verification.hashed == ()
    assert second.generate([[1, 2, 3]])[0].token_ids  # the verified dir serves


@pytest.mark.parametrize("mtime", ["changed", "restored"])
def test_same_size_overwrite_of_weights_is_refused(engines, mtime):
    """Restoring the mtime with os.utime does not hide the write: the kernel sets ctime on
    every write and utime call, and the cache compares it too."""
    prime(engines)
    weights = engines / "weights.bin"
    before = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(before.st_size // 2)
        chunk = f.read(4096)
        f.seek(before.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    if mtime == "restored":
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert weights.stat().st_mtime_ns == before.st_mtime_ns
    assert weights.stat().st_size == before.st_size
    with pytest.raises(ManifestError, match=f"weights.bin: content differs.*{REBUILD} {engines}"):
        LLM(engines)


def test_shuffled_vocabulary_is_refused(engines):
    prime(engines)
    path = engines / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    special = {t["content"] for t in data["added_tokens"]}
    for digits in (1, 2, 3):  # ids of one width trade places: the file keeps its size
        tokens = [t for t, i in vocab.items() if t not in special and len(str(i)) == digits]
        ids = [vocab[t] for t in tokens]
        random.Random(digits).shuffle(ids)
        vocab.update(zip(tokens, ids))
    size = path.stat().st_size
    Tokenizer.from_str(json.dumps(data)).save(str(path))  # the same writer: same size, other content
    assert path.stat().st_size == size
    with pytest.raises(ManifestError, match="tokenizer.json: content differs"):
        LLM(engines)


@pytest.mark.parametrize("name", ["tokenizer.json", "target_step.onnx"])
def test_deleted_file_is_refused_naming_it(engines, name):
    prime(engines)
    (engines / name).unlink()
    with pytest.raises(ManifestError, match=f"{name}: missing.*rebuild it with `{REBUILD} {engines}`"):
        LLM(engines)


def test_truncated_file_is_refused_by_its_size_without_hashing(engines, hashes):
    with open(engines / "weights.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ManifestError, match=r"weights.bin: size differs \(1,000 bytes, the manifest records"):
        LLM(engines)
    assert hashes == []


def test_touched_file_is_hashed_again_and_still_loads(engines, hashes):
    prime(engines)
    hashes.clear()
    weights = engines / "weights.bin"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert LLM(engines).verification.hashed == ("weights.bin",) and hashes == ["weights.bin"]
    assert LLM(engines).verification.hashed == () and hashes == ["weights.bin"]


def test_read_only_engine_dir_loads_and_caches_per_user(engines, hashes, user_cache, monkeypatch):
    mkstemp = tempfile.mkstemp

    def refuse_inside(*args, dir=None, **kwargs):
        # root writes through chmod: refuse as the kernel would for anyone else (or on a read-only mount)
        if dir is not None and Path(dir) == engines:
            raise PermissionError(13, "Permission denied", str(dir))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(integrity.tempfile, "mkstemp", refuse_inside)
    (engines / integrity.CACHE_FILE).unlink(missing_ok=True)
    modes = {p: p.stat().st_mode for p in [engines, *engines.iterdir()]}
    for p in engines.iterdir():
        p.chmod(0o444)
    engines.chmod(0o555)
    try:
        first = LLM(engines)
        second = LLM(engines)
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    cache = integrity.user_cache_file(engines)
    assert first.verification.cache == cache and cache.is_relative_to(user_cache) and cache.exists()
    assert not (engines / integrity.CACHE_FILE).exists()
    assert second.verification.hashed == () and len(hashes) == len(read_manifest(engines)["files"])


@pytest.mark.parametrize("text, problem", [
    ("{not json", "cannot be read as JSON"),
    ("[2]", "expected an object"),
    ('{"verify_width_per_batch": [2]}', "expected an object"),
    ('{"verify_width_per_batch": {"1": 7}}', "verify width 7 for batch size 1 is not one the engines were built for"),
    ('{"verify_width_per_batch": {"1": "2"}}', "verify width '2'"),
    ('{"verify_width_per_batch": {"-1": 2}}', "batch size '-1' is not a positive integer"),
])
def test_bad_runtime_settings_are_refused_naming_the_file(engines, text, problem):
    (engines / "runtime_settings.json").write_text(text)
    with pytest.raises(ManifestError, match=f"runtime_settings.json.*{problem}.*tandem profile"):
        LLM(engines)


def test_tokenizer_that_does_not_load_is_refused_naming_it(engines):
    """A tokenizer.json the manifest records as it is (built from a broken checkpoint)."""
    path = engines / "tokenizer.json"
    path.write_text('{"model": {}}')
    manifest = json.loads((engines / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = file_sha256(path)
    manifest["file_sizes"]["tokenizer.json"] = path.stat().st_size
    (engines / "manifest.json").write_text(json.dumps(signed(manifest)))
    with pytest.raises(ManifestError, match=f"{path} cannot be loaded"):
        LLM(engines)


@pytest.mark.parametrize("change", ["no runtime", "list", "path outside", "engine file not listed", "size text"])
def test_damaged_manifest_is_refused_naming_it(engines, change):
    path = engines / "manifest.json"
    m = json.loads(path.read_text())
    if change == "no runtime":
        del m["runtime"]
    elif change == "list":
        m = [m]
    elif change == "path outside":
        m["files"]["../config.json"] = m["files"]["config.json"]
    elif change == "engine file not listed":
        del m["files"][m["engines"][0]["file"]]
    else:
        m["file_sizes"]["config.json"] = "848"
    path.write_text(json.dumps(signed(m) if isinstance(m, dict) else m))   # (written so, not edited after)
    with pytest.raises(ManifestError, match=f"{path} is (damaged|not a tandem engine manifest)"):
        LLM(engines)


@pytest.mark.parametrize("name, text", [
    ("tokenizer_config.json", "{broken"),
    ("tokenizer_config.json", "[]"),
    ("tokenizer_config.json", '{"chat_template": 3}'),
    ("chat_template.jinja", "{% if %}"),
])
def test_chat_template_file_errors_name_the_file(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ChatTemplateError, match=str(tmp_path / name)):
        ChatTemplate.from_engine_dir(tmp_path)


def test_engine_dir_of_another_graph_contract_is_refused(engines):
    """Graphs built for an older contract would run with other semantics (e.g. contract 1's
    sampled acceptance): refused with the rebuild command, never served."""
    path = engines / "manifest.json"
    m = json.loads(path.read_text())
    m["contract_version"] -= 1
    path.write_text(json.dumps(signed(m)))
    with pytest.raises(ManifestError, match=f"graph contract {m['contract_version']}.*{REBUILD}"):
        LLM(engines)


def _weights(engines: Path) -> str:
    """The largest file the manifest records (the weights)."""
    files = read_manifest(engines)["files"]
    return max(files, key=lambda n: (engines / n).stat().st_size)


def test_a_file_taken_out_of_the_manifest_is_refused(engines):
    """Removing a file's entry cannot get a corrupted file served: by hand, the manifest's own sha256
    no longer matches; written so (signed), the file is one the manifest does not record."""
    path, name = engines / "manifest.json", _weights(engines)
    with open(engines / name, "r+b") as f:              # corrupted in place, same size
        f.seek(100)
        f.write(b"\xff" * 16)
    m = json.loads(path.read_text())
    del m["files"][name], m["file_sizes"][name]
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="edited after the build"):
        LLM(engines)
    path.write_text(json.dumps(signed(m)))
    with pytest.raises(ManifestError, match=f"{name}: not a file the manifest records.*{REBUILD}"):
        LLM(engines)


def test_a_file_copied_into_the_dir_is_refused_and_tandems_own_are_not(engines):
    (engines / "runtime_settings.json").write_text("{}")      # `tandem profile`'s
    (engines / "extra.onnx").write_bytes(b"x")
    with pytest.raises(ManifestError, match=r"extra\.onnx: not a file the manifest records"):
        LLM(engines)
    (engines / "extra.onnx").unlink()
    integrity.verify_engine_dir(engines, read_manifest(engines))


def test_a_symlinked_weights_file_is_refused_saying_how_to_copy(engines, tmp_path):
    name = _weights(engines)
    target = tmp_path / "elsewhere.bin"
    shutil.move(engines / name, target)
    (engines / name).symlink_to(target)
    with pytest.raises(ManifestError, match=f"{name}: a symbolic link.*cp -rL"):
        LLM(engines)


def test_no_verify_checks_sizes_only(engines):
    """verify=False (`--no-verify`): a same-size change passes, a size change does not."""
    from tandem.pipeline.llm import RuntimeConfig

    path = engines / "generation_config.json"
    text = path.read_text()
    path.write_text(text.replace(" ", "\t", 1) if " " in text else text)
    assert LLM(engines, RuntimeConfig(verify=False)).verification.hashed == ()
    with pytest.raises(ManifestError, match="content differs"):
        LLM(engines)
    path.write_text(text + " ")
    with pytest.raises(ManifestError, match="size differs"):
        LLM(engines, RuntimeConfig(verify=False))
