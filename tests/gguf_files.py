"""GGUF files for the tests, written with the ``gguf`` package's own writer, and the
check their refusals share."""

from __future__ import annotations

import gguf
import pytest


def write_gguf(path, tensors, architecture="llama", metadata=None):
    """A GGUF file at ``path``.

    ``tensors`` maps a name to a float array (F32/F16 by its dtype) or to ``(bytes array,
    GGML type)``. ``metadata`` maps a key to its value, typed by the value (bool, int as
    uint32, float as float32, str, list as an array), or names one of the writer's own
    ``add_*`` methods (``"add_block_count": 2``), which types and prefixes it as
    llama.cpp's converter does.
    """
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in (metadata or {}).items():
        if key.startswith("add_"):
            getattr(writer, key)(value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line(error: pytest.ExceptionInfo, *parts: str) -> None:
    """The error's message is one line holding each of ``parts``."""
    text = str(error.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text


def family_files(tmp_path_factory, families, hf_model, convert, arches) -> dict[str, tuple]:
    """family -> (its tiny transformers model, that model written as a GGUF file the way
    llama.cpp's converter writes it: ``convert(model, family)`` gives the arrays and
    metadata, ``arches[family]`` the architecture: a ``gguf.MODEL_ARCH``, or its name
    where the gguf package names none, e.g. ``"deepseek32"``)."""
    out = {}
    for i, family in enumerate(families):
        model = hf_model(family, seed=i)
        arrays, meta = convert(model, family)
        arch = arches[family]
        path = write_gguf(tmp_path_factory.mktemp(family) / f"{family}.gguf", arrays,
                          arch if isinstance(arch, str) else gguf.MODEL_ARCH_NAMES[arch], meta)
        out[family] = model, path
    return out


def refused(path, *parts: str) -> None:
    """Reading the model of the file at ``path`` fails with one line holding ``parts``."""
    from qkv.models.gguf_model import read_gguf_model

    with pytest.raises(ValueError) as error:
        read_gguf_model(path)
    one_line(error, str(path), *parts)


@pytest.fixture
def no_reads(monkeypatch):
    """Fails a test that reads any tensor (a refusal must come from the metadata)."""
    from qkv.models import gguf_model

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the file was checked")
    monkeypatch.setattr(gguf_model, "read_gguf_tensors", refuse)
