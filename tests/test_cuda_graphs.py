"""The decode step replayed as CUDA graphs (`llama.runtime.cuda_graphs`): on any machine, its bookkeeping with the
recording stood in for by a replay that reruns the step; on a GPU, the real graphs against the eager step, bit for bit.
"""

import pytest
import torch
from helpers import ATOL, GQA_PARAMS, load_tiny

import llama.runtime.cuda_graphs as cuda_graphs
from llama.checkpoint import check_kv_cache_fits, random_weights
from llama.model import KVCache, ModelArgs
from llama.runtime.cuda_graphs import CUDAGraphDecodeStep, decode_step_bytes
from llama.runtime.steps import use_cuda_graphs


class RerunGraph:
    """Stands in for a recorded graph: a replay runs the step again on the recorded inputs, into the same output
    tensor, as a CUDA graph replay does."""

    def __init__(self, step, inputs, output):
        self.step, self.inputs, self.output = step, inputs, output

    def replay(self):
        self.output.copy_(self.step(*self.inputs))


@pytest.fixture
def rerun_recording(monkeypatch):
    """`llama.runtime.cuda_graphs.record` replaced by `RerunGraph`s; returns the list of recordings made."""
    recordings = []

    def record(step, pool, *inputs):
        recordings.append(inputs[0].shape[0])
        output = step(*inputs)
        return RerunGraph(step, inputs, output), output

    monkeypatch.setattr(cuda_graphs, "record", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    return recordings


def steps_through(step, model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits of positions prompt_len.. of `tokens`: the prompt through `forward`, then `step` one token at a time."""
    model(tokens[:, :prompt_len], 0)
    logits = []
    for pos in range(prompt_len, tokens.shape[1]):
        logits.append(step(tokens[:, pos : pos + 1], torch.tensor([pos], device=tokens.device)))
    return torch.cat(logits, dim=1)


def test_graph_step_feeds_each_step_its_own_inputs(process_group, tmp_path, rerun_recording):
    """Each call copies its tokens and position into the recorded inputs: the logits are the eager step's at
    every position, one recording per batch size, and logits handed out are not overwritten by the next step."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=21), torch.float32)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(3))
    expected = steps_through(model.decode_step, model, tokens, prompt_len=5)
    step = CUDAGraphDecodeStep(model)
    handed_out = []

    def keeping_each_output(*inputs):
        handed_out.append(step(*inputs))
        return handed_out[-1]

    got = steps_through(keeping_each_output, model, tokens, prompt_len=5)
    assert expected.abs().max() > 1
    assert torch.equal(got, expected)
    assert torch.equal(torch.cat(handed_out, dim=1), expected)  # each still holds its own step's logits
    assert rerun_recording == [2]
    expected_one_row = steps_through(model.decode_step, model, tokens[1:], prompt_len=7)
    assert torch.equal(steps_through(step, model, tokens[1:], prompt_len=7), expected_one_row)
    assert rerun_recording == [2, 1]


def test_graph_step_records_again_after_the_caches_are_reallocated(process_group, tmp_path, rerun_recording):
    """A graph reads the KV cache at the address it was recorded with; after `init_kv_caches` makes new caches,
    replaying the old graph would attend to the old cache, so the step records again."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=22), torch.float32)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(4))
    step = CUDAGraphDecodeStep(model)
    steps_through(step, model, tokens, prompt_len=4)
    recorded_caches = [layer.attention.kv_cache for layer in model.layers]  # held: no new cache can land there
    model.init_kv_caches(torch.device("cpu"), torch.float32)
    expected = steps_through(model.decode_step, model, tokens, prompt_len=4)
    model.init_kv_caches(torch.device("cpu"), torch.float32)
    moved = [
        old.cache_k.data_ptr() != layer.attention.kv_cache.cache_k.data_ptr()
        for old, layer in zip(recorded_caches, model.layers)
    ]
    assert all(moved)
    assert torch.equal(steps_through(step, model, tokens, prompt_len=4), expected)
    assert rerun_recording == [2, 2]


def test_graph_step_records_again_when_only_a_later_layers_cache_moved(process_group, tmp_path, rerun_recording):
    """New caches may land where old ones were freed: the first layer's cache back at its recorded address says
    nothing of the others', so a move of the last layer's cache alone records again."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=24), torch.float32)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(6))
    step = CUDAGraphDecodeStep(model)
    steps_through(step, model, tokens, prompt_len=4)
    last = model.layers[-1].attention
    recorded_cache = last.kv_cache  # held, so that the new cache cannot be allocated where it was
    last.kv_cache = KVCache(*recorded_cache.cache_k.shape, dtype=torch.float32)
    expected = steps_through(model.decode_step, model, tokens, prompt_len=4)
    assert torch.equal(steps_through(step, model, tokens, prompt_len=4), expected)
    assert rerun_recording == [1, 1]


def test_grouped_heads_attend_as_the_reference_does(process_group, tmp_path):
    """decode_step attends with each kv head's query heads as rows of one head (no copies of the cache); its
    logits are those of `forward`, which shares kv heads inside the attention kernel."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=23), torch.float32)
    assert model.layers[0].attention.n_rep == 2
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(5))
    expected = model(tokens, 0)[:, 6:]
    got = steps_through(model.decode_step, model, tokens, prompt_len=6)
    assert (got - expected).abs().max() < ATOL


def test_grouped_heads_take_any_memory_order_of_the_attention_output(process_group, tmp_path, monkeypatch):
    """CUDA's attention kernels may return (batch, heads, positions, head_dim) stored as (batch, positions, heads,
    head_dim); the grouped heads must be read back in either order (`view` failed on batches of 3 there)."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=23), torch.float32)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    expected = steps_through(model.decode_step, model, tokens, prompt_len=6)
    attention = torch.nn.functional.scaled_dot_product_attention

    def stored_as_on_cuda(*args, **kwargs):
        return attention(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", stored_as_on_cuda)
    assert torch.equal(steps_through(model.decode_step, model, tokens, prompt_len=6), expected)


def test_graphs_are_used_on_one_cuda_process_unless_turned_off():
    assert use_cuda_graphs(torch.device("cuda", 0), 1, requested=True)
    assert not use_cuda_graphs(torch.device("cuda", 0), 1, requested=False)
    assert not use_cuda_graphs(torch.device("cuda", 0), 2, requested=True)  # NCCL all-reduces stay eager
    assert not use_cuda_graphs(torch.device("cpu"), 1, requested=True)


def test_cpu_build_decodes_eagerly(tiny_llama):
    """On the CPU the one-token steps run through `forward`, as in the reference."""
    assert tiny_llama.decoder.decode_step is None


def test_kv_cache_check_counts_the_graphs_memory_on_cuda(monkeypatch):
    """On CUDA a recorded graph keeps a step's activations: a cache that fits alone but not with them is refused
    before anything is allocated; on the CPU the same free memory is enough."""
    args = ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, max_seq_len=2048,
                     max_batch_size=8)  # fmt: skip
    cache = 2 * 16 * 8 * 2048 * 8 * 64 * 2
    step = decode_step_bytes(args, 1, torch.bfloat16)
    assert step > 8 * 128256 * 2  # at least the bfloat16 logits of every row
    monkeypatch.setattr("llama.checkpoint.load.free_memory", lambda device: cache + step // 2)
    check_kv_cache_fits(args, 1, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="KV cache and a decode step's activations .* lower max_batch_size"):
        check_kv_cache_fits(args, 1, torch.device("cuda", 0), torch.bfloat16)
    monkeypatch.setattr("llama.checkpoint.load.free_memory", lambda device: cache + step)
    check_kv_cache_fits(args, 1, torch.device("cuda", 0), torch.bfloat16)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_the_eager_step_bit_for_bit(process_group, tmp_path, dtype):
    """The real graphs on a GPU: the same kernels on the same inputs, so the eager step's logits bit for bit, for
    two batch sizes recorded one after the other and replayed in turn."""
    from llama.checkpoint import load_model, model_args_from, open_checkpoint, write_meta_checkpoint
    from llama.runtime import for_runtime

    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, random_weights(GQA_PARAMS, seed=24))
    reader = open_checkpoint(tmp_path / "ckpt")
    args = model_args_from(reader.params, max_seq_len=32, max_batch_size=3)[0]
    model = for_runtime(load_model(reader, args, 0, 1, torch.device("cuda"), dtype))[0]
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(9)).cuda()
    step = CUDAGraphDecodeStep(model)
    for rows in (3, 1, 3):  # a second batch size, then the first one's graph again
        expected = steps_through(model.decode_step, model, tokens[:rows], prompt_len=7)
        got = steps_through(step, model, tokens[:rows], prompt_len=7)
        assert torch.equal(got, expected)
    assert sorted(step.steps) == [1, 3]
