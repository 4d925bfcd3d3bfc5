"""Weight-only quantization (llama/quantize.py): the rounding error each scheme promises, the kernels against the
dequantized weights' math, layers int4 cannot hold, `quantize_model` on a model built as Meta's code builds it,
`Llama.build(quantize=)`, and clear errors. Accuracy on a trained model: test_quantize_accuracy.py; 1 versus 2
processes: test_parallel.py.
"""

import json
import os

import pytest
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from helpers import GQA_PARAMS

from llama import Llama
from llama.checkpoint import load_model, model_args_from, open_checkpoint, random_weights, write_meta_checkpoint
from llama.checkpoint.convert import meta_to_hf, quantize_checkpoint
from llama.checkpoint.shards import CheckpointReader
from llama.model import Transformer
from llama.quantize import dequantize, quantize_int4, quantize_int8, unpack_nibbles
from llama.runtime import for_runtime, quantize_model
from llama.runtime.quantized import Int4Linear, Int8Linear, inner_k_tiles, quantize_layer, quantized_bytes


def random_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_rounds_each_weight_to_the_nearest_step_of_its_row():
    weight = random_weight(64, 96)
    weight[3] = 0  # a row of zeros must not divide by zero
    q, scales = quantize_int8(weight, torch.float32)
    assert q.dtype == torch.int8 and q.abs().max() == 127  # the largest magnitude of a row maps to +-127
    error = (dequantize(q, scales) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert torch.equal(dequantize(q, scales)[3], torch.zeros(96))


def test_int4_rounds_each_weight_to_the_nearest_of_16_levels_of_its_group():
    weight = random_weight(32, 128)
    q, scales, zeros = quantize_int4(weight, 32, torch.float32)
    assert scales.shape == zeros.shape == (32, 4)
    assert q.shape == (32, 64)  # two values per byte
    assert unpack_nibbles(q).min() == 0 and unpack_nibbles(q).max() == 15
    error = (dequantize(q, scales, zeros) - weight).abs()
    assert (error <= scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def fairscale_layer(kind, in_features: int, out_features: int, weight: torch.Tensor):
    if kind is RowParallelLinear:
        layer = kind(in_features, out_features, bias=False, input_is_parallel=True, init_method=lambda x: x)
    else:
        layer = kind(in_features, out_features, bias=False, gather_output=False, init_method=lambda x: x)
    layer.weight.data.copy_(weight)
    return layer


@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear], ids=["column", "row"])
@pytest.mark.parametrize(
    "shape, scheme, requested, expected_type, group_size",
    [
        ((64, 256), "int8", None, Int8Linear, None),
        ((64, 256), "int4", None, Int4Linear, 32),
        ((64, 256), "int4", 128, Int4Linear, 128),
        ((48, 576), "int4", 128, Int4Linear, 64),  # SmolLM2's width: 576 = 9 x 64, not a multiple of 128
        ((32, 96), "int4", 64, Int4Linear, 32),  # 96 = 3 x 32
        ((32, 40), "int4", None, Int8Linear, None),  # no int4 group divides 40: the layer is int8
        ((40, 64), "int4", None, Int8Linear, None),  # the int4 CPU kernel takes outputs in multiples of 16 only
        ((1040, 2048), "int8", None, Int8Linear, None),  # quantized in two blocks of rows (1024 and 16)
        ((1040, 2048), "int4", None, Int4Linear, 32),  # quantized and converted in two blocks of rows
    ],
)
def test_quantized_layer_computes_with_the_dequantized_weight(
    process_group, kind, shape, scheme, requested, expected_type, group_size
):
    rows, cols = shape
    weight = random_weight(rows, cols, seed=rows + cols)
    layer = quantize_layer(fairscale_layer(kind, cols, rows, weight), scheme, requested)
    assert type(layer) is expected_type
    if expected_type is Int4Linear:
        assert layer.group_size == group_size
        q, scales, zeros = quantize_int4(weight, group_size, torch.float32)
        expected_weight = dequantize(q, scales, zeros)
    else:
        expected_weight = dequantize(*quantize_int8(weight, torch.float32))
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (2, 3, rows)
    torch.testing.assert_close(out, x @ expected_weight.t(), atol=1e-4, rtol=1e-4)
    assert (out - x @ weight.t()).abs().max() > 0  # quantized, not the float weight


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantizing_a_weight_that_requires_grad_keeps_no_autograd_history(process_group, scheme):
    """Meta's model as built has weights that require grad; quantizing one block of rows at a time must not keep
    every block's float32 copy alive through autograd (on an 8B model, more memory than a GPU has)."""
    layer = fairscale_layer(ColumnParallelLinear, 256, 64, random_weight(64, 256))
    assert layer.weight.requires_grad
    quantized = quantize_layer(layer, scheme)
    assert all(not t.requires_grad and t.grad_fn is None for t in quantized.buffers())


@pytest.mark.parametrize("width, tiles", [(4096, 8), (14336, 8), (576, 4), (96, 2), (32, 2)])
def test_cuda_int4_tiling_fits_every_int4_width(width, tiles):
    assert inner_k_tiles(width) == tiles
    assert width % (16 * inner_k_tiles(width)) == 0


def tiny_reader(tmp_path, seed: int = 3):
    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, random_weights(GQA_PARAMS, seed))
    reader = open_checkpoint(tmp_path / "ckpt")
    return reader, model_args_from(reader.params, max_seq_len=32, max_batch_size=2)[0]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_model_on_a_model_built_the_reference_way(process_group, tmp_path, scheme):
    """Meta's way (Transformer(args), load_state_dict, fairscale layers) then quantize_model gives the logits that
    quantizing at load gives, and every linear layer and the head are quantized."""
    reader, args = tiny_reader(tmp_path)
    reference = Transformer(args)
    reference.load_state_dict({key: reader.read(key).to(torch.bfloat16) for key in reader.shapes})
    reference = quantize_model(reference.to(torch.bfloat16), scheme)
    quantized_types = (Int8Linear, Int4Linear)
    assert sum(isinstance(m, quantized_types) for m in reference.modules()) == 7 * args.n_layers + 1
    assert reference.tok_embeddings.weight.dtype == torch.bfloat16  # the embedding table is not quantized

    loaded = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.bfloat16, quantize=scheme))[0]
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = reference(tokens, 0)
    torch.testing.assert_close(loaded(tokens, 0), expected, atol=0, rtol=0)

    float_model = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.bfloat16))[0]
    float_logits = float_model(tokens, 0)
    relative_error = ((expected - float_logits).norm() / float_logits.norm()).item()
    assert 0 < relative_error < {"int8": 0.05, "int4": 0.3}[scheme]


def test_build_quantizes_and_defaults_to_bfloat16_on_cpu(tiny_checkpoint, tokenizer_path, process_group):
    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=32, max_batch_size=1, device="cpu", quantize="int8"
    )
    model = generator.model
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.layers[0].attention.wq.weight.dtype == torch.int8
    assert model.output.weight.dtype == torch.int8
    float_bytes = sum(p.numel() * 2 for m in model.modules() if isinstance(m, Int8Linear) for p in [m.weight])
    int8_bytes = sum(m.weight.numel() + m.scales.numel() * 2 for m in model.modules() if isinstance(m, Int8Linear))
    assert int8_bytes < 0.52 * float_bytes
    text = generator.text_completion(["The moon is"], temperature=0, max_gen_len=4)[0]["generation"]
    assert isinstance(text, str) and text


def test_unknown_scheme_is_a_clear_error(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError, match="Unknown quantization scheme 'int3'; use one of int8, int4"):
        Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=32, max_batch_size=1, quantize="int3")


def test_bad_group_size_and_device_without_kernels_are_clear_errors(process_group, tmp_path):
    _, args = tiny_reader(tmp_path)
    model = Transformer(args)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_model(model, "int4", group_size=100)
    with pytest.raises(ValueError, match="PyTorch has no such kernel for meta"):
        quantize_model(model.to("meta"), "int8")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n_shards", [1, 2])
def test_quantized_checkpoint_loads_as_quantizing_at_load_does(process_group, tmp_path, scheme, n_shards):
    """`python -m llama.convert quantize` writes quantized weights only (no float copy of a linear layer), and
    loading them, from 1 or 2 shards into one process, gives the logits that quantizing at load gives."""
    reader, args = tiny_reader(tmp_path)
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", scheme, model_parallel_size=n_shards)
    shard = torch.load(tmp_path / "q" / "consolidated.00.pth", weights_only=True)
    stored_dtype = {"int8": torch.int8, "int4": torch.uint8}[scheme]
    assert shard["layers.1.feed_forward.w2.weight"].dtype == stored_dtype
    assert shard["output.weight"].dtype == stored_dtype
    float_keys = {key for key, tensor in shard.items() if tensor.is_floating_point()}
    assert all(key.endswith(("scales", "zeros", "norm.weight")) for key in float_keys - {"tok_embeddings.weight"})

    cpu = torch.device("cpu")
    expected = load_model(reader, args, 0, 1, cpu, torch.bfloat16, quantize=scheme)
    stored = open_checkpoint(tmp_path / "q")
    loaded = load_model(stored, args, 0, 1, cpu, torch.bfloat16)
    assert quantized_bytes(loaded) == quantized_bytes(expected)
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(tokens, 0), expected(tokens, 0), atol=0, rtol=0)


def test_quantized_checkpoint_errors(process_group, tiny_checkpoint, tokenizer_path, tmp_path):
    quantized = tmp_path / "q8"
    quantize_checkpoint(tiny_checkpoint, quantized, "int8")
    generator = Llama.build(str(quantized), tokenizer_path, max_seq_len=32, max_batch_size=1)  # loads as stored
    assert generator.model.output.weight.dtype == torch.int8
    assert generator.model.tok_embeddings.weight.dtype == torch.bfloat16  # as with quantize= on the CPU
    with pytest.raises(ValueError, match="quantized as int8; they cannot be loaded as int4. Pass quantize='int8'"):
        Llama.build(str(quantized), tokenizer_path, max_seq_len=32, max_batch_size=1, quantize="int4")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(quantized, tmp_path / "again", "int4")
    with pytest.raises(ValueError, match="Hugging Face's layout has no place for"):
        meta_to_hf(quantized, tmp_path / "hf")

    int4 = tmp_path / "q4"
    quantize_checkpoint(tiny_checkpoint, int4, "int4", group_size=32)
    params = json.loads((int4 / "params.json").read_text())
    params["quantization"]["group_size"] = 64  # not what the stored scales and zeros were made with
    (int4 / "params.json").write_text(json.dumps(params))
    # The first tensor checked is the head's (the load reads it first, after the embedding).
    with pytest.raises(ValueError, match=r"output.scales in .* has shape \(128256, 2\), but .* \(128256, 1\)"):
        Llama.build(str(int4), tokenizer_path, max_seq_len=32, max_batch_size=1)

    params = json.loads((quantized / "params.json").read_text())
    params["quantization"] = {"scheme": "fp8"}
    (quantized / "params.json").write_text(json.dumps(params))
    with pytest.raises(ValueError, match="quantized as {'scheme': 'fp8'}, a scheme this version of llama does not"):
        Llama.build(str(quantized), tokenizer_path, max_seq_len=32, max_batch_size=1)
    with pytest.raises(ValueError, match="Unknown quantization scheme 'int2'"):
        quantize_checkpoint(tiny_checkpoint, tmp_path / "bad", "int2")
    assert not (tmp_path / "bad").exists()


def test_quantizing_a_hugging_face_folder_gives_the_meta_checkpoints_tensors(tmp_path):
    tiny_reader(tmp_path)  # writes tmp_path / "ckpt"
    meta_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "from_meta", "int4")
    quantize_checkpoint(tmp_path / "hf", tmp_path / "from_hf", "int4")
    from_meta = torch.load(tmp_path / "from_meta" / "consolidated.00.pth", weights_only=True)
    from_hf = torch.load(tmp_path / "from_hf" / "consolidated.00.pth", weights_only=True)
    assert from_meta.keys() == from_hf.keys()
    for key in from_meta:  # q and k un-permuted from Hugging Face's layout before they are quantized
        assert torch.equal(from_meta[key], from_hf[key]), key
    meta_params = json.loads((tmp_path / "from_meta" / "params.json").read_text())
    assert json.loads((tmp_path / "from_hf" / "params.json").read_text())["quantization"] == meta_params["quantization"]


def mapped_bytes(path) -> int:
    """Bytes of the file at `path` this process holds in memory: the resident pages of its mappings (Linux)."""
    held, in_file = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line: its range, ..., its path
                in_file = fields[-1] == str(path)
            elif in_file and fields[0] == "Rss:":
                held += int(fields[1]) * 1024
    return held


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["meta", "hf"])
def test_a_quantized_load_lets_go_of_the_checkpoint_pages_it_quantized(
    process_group, tmp_path, monkeypatch, layout, scheme
):
    """Once quantized, a layer's pages of the mapped checkpoint are not held: after the load, the process holds a
    small part of the file instead of all of it, and the model computes the same logits (a Meta checkpoint's
    embedding, still mapped, is read from the file again)."""
    params = {**GQA_PARAMS, "dim": 512, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 1024}
    write_meta_checkpoint(tmp_path / "meta", params, random_weights(params, seed=5))
    if layout == "hf":
        meta_to_hf(tmp_path / "meta", tmp_path / "hf")
    source = tmp_path / layout
    tokens = torch.randint(0, params["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))

    def held_after_load_and_logits():
        reader = open_checkpoint(source)
        args = model_args_from(reader.params, max_seq_len=16, max_batch_size=2)[0]
        model = load_model(reader, args, 0, 1, torch.device("cpu"), torch.bfloat16, quantize=scheme)
        (mapped,) = reader.mapped_files()
        return mapped.resolve(), mapped_bytes(mapped.resolve()), model(tokens, 0)

    path, held, logits = held_after_load_and_logits()
    monkeypatch.setattr(CheckpointReader, "forget_read_pages", lambda self: None)
    _, held_without, expected = held_after_load_and_logits()
    size = path.stat().st_size
    assert held_without > 0.9 * size
    assert held < 0.1 * size
    assert torch.equal(logits, expected)
