"""Model parallelism on CPU: tests/parallel_worker.py run under torchrun with gloo, on tiny random checkpoints.

What a user would notice, each checked against one plain `python` process on the 1-shard checkpoint of the
same weights (the reference output):
- `torchrun --nproc_per_node 2` on a 2-shard checkpoint gives the same greedy tokens, and every rank samples
  the same tokens; only rank 0 prints.
- Any shard count N on disk runs on any M processes (1->2, 2->1, 4->2, 2->4): each rank holds exactly the
  slice the native M-shard layout would give it, and the output is the same.
- Two torchrun invocations as two nodes give the same output; only global rank 0 prints.
- When one rank fails or hangs, the others exit with an error instead of waiting forever: under one torchrun
  long before their own collective timeout (its agent stops the group), and within the process-group timeout
  plus some slack for separate invocations (multi-node), where the survivor has only that timeout to rely on.

Every run is a subprocess with a deadline, so a hang fails the test, naming the run, instead of blocking CI. The
deadlines are minutes, to leave room for a crowded 2-core machine: the tests check what ends a run, not how fast.
"""

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from helpers import TINY_PARAMS, free_port, make_checkpoint, with_repo

from llama.checkpoint import random_weights, split_dim

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test launches processes, most of them torchrun

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("parallel_worker.py")
RUN_DEADLINE = 300  # seconds for any one run; a healthy one takes about 10 on 2 CPU cores
AGENT_ONLY_TIMEOUT = 600  # the one-torchrun fault runs' collective timeout: past RUN_DEADLINE, only the agent ends them
FAULT_TIMEOUT = 10  # Llama.build(timeout=...) in the multi-node fault runs, seconds
# Seconds a survivor may take beyond FAULT_TIMEOUT to notice, fail and exit, on a crowded machine too; without
# FAULT_TIMEOUT it would wait for torch's default process-group timeout, 30 minutes.
SLACK = 120
SEED = 0  # random_weights seed shared by every checkpoint, so all layouts hold the same weights
MAX_GEN_LEN = 16  # parallel_worker's default

PARAMS = {
    "gqa": TINY_PARAMS,  # 4 heads sharing 2 kv heads: model-parallel sizes 1 and 2
    "mp4": dict(TINY_PARAMS, n_heads=8, n_kv_heads=4),  # splits up to 4 ways
    # int4 groups of 64 inputs and blocks of 16 outputs that a 2-way split does not cut
    "quant": dict(TINY_PARAMS, dim=128, multiple_of=64),
}


@dataclass
class Run:
    """One finished launch: exit codes and logs per invocation, and what each rank wrote."""

    returncodes: List[int]
    stdouts: List[str]
    stderrs: List[str]
    ended: List[float]  # time.time() at which each invocation was seen to exit
    out_prefix: Path

    def results(self, world_size: int) -> List[dict]:
        """Each rank's JSON, after checking that all ranks decoded the same tokens."""
        return json_results(self.out_prefix, world_size)


def json_results(out_prefix, world_size: int) -> List[dict]:
    """Each rank's JSON of a worker's run written under `out_prefix`, after checking that all ranks decoded the same
    tokens."""
    ranks = [json.loads(Path(f"{out_prefix}.rank{r}.json").read_text()) for r in range(world_size)]
    for rank in ranks[1:]:
        assert rank["greedy"] == ranks[0]["greedy"], f"rank {rank['rank']} decoded other greedy tokens"
        assert rank["sampled"] == ranks[0]["sampled"], f"rank {rank['rank']} sampled other tokens"
    return ranks


def worker_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = with_repo(REPO)
    return env


def torchrun(*launcher_args) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *map(str, launcher_args), str(WORKER)]


@dataclass
class Started:
    """Commands `start` launched together, for `finish` to wait for."""

    commands: List[List[str]]
    procs: List[subprocess.Popen]
    logs: List[Tuple[Path, Path]]  # each command's stdout and stderr files
    out_prefix: Path
    wait_for: List[int]
    deadline: float  # time.monotonic() by which those in wait_for must have exited


def start(
    commands: List[List[str]],
    ckpt: Path,
    tokenizer_path: str,
    out_prefix: Path,
    *worker_args,
    wait_for: Optional[List[int]] = None,
    **extra_env: str,
) -> Started:
    """Start the commands together, each followed by the worker's arguments, in `worker_env` plus `extra_env`;
    those in `wait_for` (default: all) are given RUN_DEADLINE seconds from now to exit."""
    wait_for = list(range(len(commands))) if wait_for is None else wait_for
    args = [str(ckpt), tokenizer_path, str(out_prefix), *map(str, worker_args)]
    logs = [(Path(f"{out_prefix}.{i}.stdout"), Path(f"{out_prefix}.{i}.stderr")) for i in range(len(commands))]
    procs = []
    for command, (stdout, stderr) in zip(commands, logs):
        with open(stdout, "w") as out, open(stderr, "w") as err:
            procs.append(
                subprocess.Popen(
                    command + args, stdout=out, stderr=err, env={**worker_env(), **extra_env}, start_new_session=True
                )
            )
    return Started(commands, procs, logs, out_prefix, wait_for, time.monotonic() + RUN_DEADLINE)


def finish(*runs: Started) -> List[Run]:
    """Wait for the commands in each run's `wait_for` to exit, then stop the others. Every command's exit is seen
    (and timed, `Run.ended`) while any is waited for: runs finished together are timed alike.

    Raises:
        pytest.fail.Exception: when a command in a `wait_for` is still running at its run's deadline.
    """
    ended = [[float("nan")] * len(run.procs) for run in runs]

    def waited(run: Started) -> bool:
        return time.monotonic() < run.deadline and any(run.procs[i].returncode is None for i in run.wait_for)

    try:
        while any(waited(run) for run in runs):
            for run, times in zip(runs, ended):
                for i, proc in enumerate(run.procs):
                    if proc.returncode is None and proc.poll() is not None:
                        times[i] = time.time()
            time.sleep(0.05)
        late = [(run, i) for run in runs for i in run.wait_for if run.procs[i].returncode is None]
    finally:
        for run in runs:
            stop(run.procs, run.out_prefix)
    if late:
        hung = [
            f"{run.out_prefix.name}: {' '.join(run.commands[i])}\n{run.logs[i][1].read_text()[-2000:]}"
            for run, i in late
        ]
        pytest.fail(
            f"Still running {RUN_DEADLINE} s after launch, stopped (each with its stderr's end): " + "\n\n".join(hung)
        )
    return [
        Run(
            returncodes=[p.returncode for p in run.procs],
            stdouts=[out.read_text() for out, _ in run.logs],
            stderrs=[err.read_text() for _, err in run.logs],
            ended=times,
            out_prefix=run.out_prefix,
        )
        for run, times in zip(runs, ended)
    ]


def launch(*args, **kwargs) -> Run:
    """`start` the commands and `finish` them: a run on its own."""
    (run,) = finish(start(*args, **kwargs))
    return run


def stop(procs: List[subprocess.Popen], out_prefix: Path) -> None:
    """End what is still running: torchrun stops its workers on SIGTERM; a worker left behind is killed by
    the pid it wrote."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid_file in out_prefix.parent.glob(f"{out_prefix.name}.rank*.pid"):
        pid = int(pid_file.read_text())
        try:
            if "parallel_worker" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone


def single_node(nproc: int) -> List[List[str]]:
    return [torchrun("--standalone", "--nproc_per_node", nproc)]


def two_nodes() -> List[List[str]]:
    """Two torchrun invocations, one process each, that meet as two nodes of one job on this machine."""
    port = free_port()
    node = ["--nnodes", 2, "--nproc_per_node", 1, "--master_addr", "127.0.0.1", "--master_port", port]
    return [torchrun(*node, "--node_rank", 0), torchrun(*node, "--node_rank", 1)]


def plain_python() -> List[List[str]]:
    return [[sys.executable, str(WORKER)]]


@functools.cache
def expected_digests(name: str, mp_size: int) -> List[Dict[str, str]]:
    """Per rank, the sha256 of each float32 tensor it holds in the native mp_size-shard layout of PARAMS[name]."""
    digests = [{} for _ in range(mp_size)]
    for key, tensor in random_weights(PARAMS[name], SEED).items():
        dim = split_dim(key)
        for rank in range(mp_size):
            piece = tensor if dim is None else tensor.chunk(mp_size, dim=dim)[rank]
            digests[rank][key] = hashlib.sha256(piece.float().contiguous().numpy().tobytes()).hexdigest()
    return digests


def assert_only_rank0_printed(run: Run) -> None:
    printed = "".join(run.stdouts)
    assert printed.count("Loaded in") == 1, printed
    assert printed.count(" -> ") == 4, printed  # one line per prompt, from rank 0 only


# Fixtures: checkpoints, each written once, and the runs more than one test compares against ------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name, n_shards): the PARAMS[name] checkpoint with seed SEED, in n_shards shards."""
    cache = {}

    def get(name: str, n_shards: int) -> Path:
        if (name, n_shards) not in cache:
            out = tmp_path_factory.mktemp("parallel_ckpt") / f"{name}-{n_shards}"
            cache[name, n_shards] = make_checkpoint(out, PARAMS[name], n_shards, seed=SEED)
        return cache[name, n_shards]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint, tokenizer_path, tmp_path_factory):
    """reference(name): rank 0's results of one plain python process on the 1-shard checkpoint."""
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            out_prefix = tmp_path_factory.mktemp("parallel_ref") / name
            run = launch(plain_python(), checkpoint(name, 1), tokenizer_path, out_prefix)
            assert run.returncodes == [0], run.stderrs[0]
            cache[name] = run.results(1)[0]
            greedy = cache[name]["greedy"]
            # Non-trivial output to compare: full-length rows, different per prompt, and sampling that samples.
            assert [len(row) for row in greedy] == [MAX_GEN_LEN] * 4
            assert len({tuple(row) for row in greedy}) == 4
            sampled = cache[name]["sampled"]  # the first two prompts, half as long
            assert [len(row) for row in sampled] == [MAX_GEN_LEN // 2] * 2
            assert sampled != [row[: MAX_GEN_LEN // 2] for row in greedy[:2]]
        return cache[name]

    return get


@pytest.fixture(scope="module")
def two_processes(checkpoint, tokenizer_path, tmp_path_factory) -> Run:
    """`torchrun --nproc_per_node 2` on the 2-shard gqa checkpoint: the native layout for 2 processes."""
    run = launch(single_node(2), checkpoint("gqa", 2), tokenizer_path, tmp_path_factory.mktemp("parallel") / "out")
    assert run.returncodes == [0], run.stderrs[0]
    return run


# Correctness -------------------------------------------------------------------------------------------------


def test_two_processes_match_one_process(two_processes, reference):
    ranks = two_processes.results(2)
    assert ranks[0]["greedy"] == reference("gqa")["greedy"]
    turn = ranks[0]["next_turn"]  # prefix reuse holds across processes: each holds the same tokens
    assert min(turn["reused"]) > 0 and turn["warm"] == turn["cold"] == reference("gqa")["next_turn"]["cold"]
    assert_only_rank0_printed(two_processes)


def test_compiled_decoding_across_two_processes(checkpoint, reference, tokenizer_path, tmp_path):
    """The compiled decode step is one graph per batch size in each process, all-reduces included; the greedy
    tokens stay the same."""
    run = launch(single_node(2), checkpoint("gqa", 2), tokenizer_path, tmp_path / "out", "--compile")
    assert run.returncodes == [0], run.stderrs[0]
    ranks = run.results(2)
    assert [(rank["compiled_graphs"], rank["graph_breaks"]) for rank in ranks] == [(2, [])] * 2  # 4 and 2 rows
    assert [rank["greedy"] for rank in ranks] == [reference("gqa")["greedy"]] * 2


@pytest.mark.parametrize(
    "name, n_shards, nproc",
    [("gqa", 1, 2), ("gqa", 2, 1), ("mp4", 4, 2), ("mp4", 2, 4)],
    ids=["1to2", "2to1", "4to2", "2to4"],
)
def test_resharding(name, n_shards, nproc, checkpoint, reference, two_processes, tokenizer_path, tmp_path):
    commands = plain_python() if nproc == 1 else single_node(nproc)
    greedy_only = ["--greedy-only"] if name != "gqa" else []  # only gqa has a native run to compare samples with
    run = launch(commands, checkpoint(name, n_shards), tokenizer_path, tmp_path / "out", *greedy_only)
    assert run.returncodes == [0], run.stderrs[0]
    ranks = run.results(nproc)
    for rank in ranks:  # exactly the native nproc-shard slice, bit for bit
        assert rank["weights"] == expected_digests(name, nproc)[rank["rank"]], f"rank {rank['rank']}"
    assert ranks[0]["greedy"] == reference(name)["greedy"]
    if name == "gqa":  # the native layout ran too: same weights per rank, same reductions, same samples
        native = reference("gqa") if nproc == 1 else two_processes.results(2)[0]
        assert ranks[0]["sampled"] == native["sampled"]
    assert_only_rank0_printed(run)


def test_quantized_two_processes_match_one_process(checkpoint, tokenizer_path, tmp_path):
    """Each process quantizes its own slice, to the same values one process gives the whole weight: row-parallel
    layers (wo, w2) included, so the greedy tokens are the same, int8 from 2 native shards and int4 resharded from 1.
    So does a checkpoint quantized by `llama convert quantize`, from its native shards (int8) or resharded (int4)
    (made in bfloat16, it is checked against itself in one process, as the worker decodes in float32). The ranks
    run the same kernels, by rule. One launch of each kind runs all four checkpoints in turn."""
    from llama.checkpoint.convert import quantize_checkpoint

    one_ckpt = checkpoint("quant", 1)
    runs_one, runs_two = [], []
    for scheme, n_shards in (("int8", 2), ("int4", 1)):
        runs_one.append(f"{one_ckpt}:{scheme}")
        runs_two.append(f"{checkpoint('quant', n_shards)}:{scheme}")
        stored = tmp_path / f"quantized-{scheme}"
        quantize_checkpoint(one_ckpt, stored, scheme, model_parallel_size=n_shards)
        runs_one.append(f"{stored}:{scheme}")
        runs_two.append(f"{stored}:{scheme}")
    # Side by side: the single process runs on one thread, so the three processes share the two cores. 8 tokens:
    # PyTorch's int4 kernel is slow with float32 activations (the 128256-row head takes most of the time).
    args = ["--max-gen-len", 8, "--greedy-only", "--quantize", "int8", "--also"]
    one, two = finish(  # the first item as the launch's own checkpoint, the others --also
        start(plain_python(), one_ckpt, tokenizer_path, tmp_path / "one", *args, *runs_one[1:]),
        start(single_node(2), checkpoint("quant", 2), tokenizer_path, tmp_path / "two", *args, *runs_two[1:]),
    )
    assert one.returncodes == [0], one.stderrs[0]
    assert two.returncodes == [0], two.stderrs[0]
    for index, item in enumerate(runs_one):
        also = "" if index == 0 else f".also{index - 1}"
        (alone,) = json_results(f"{tmp_path / 'one'}{also}", 1)
        ranks = json_results(f"{tmp_path / 'two'}{also}", 2)
        assert len({tuple(row) for row in alone["greedy"]}) == 4, item
        assert ranks[0]["greedy"] == alone["greedy"], item
        assert ranks[0]["kernels"] == ranks[1]["kernels"], item


def test_hugging_face_folder_is_sliced_per_rank(checkpoint, reference, tokenizer_path, tmp_path):
    from llama.checkpoint.convert import meta_to_hf

    meta_to_hf(checkpoint("gqa", 1), tmp_path / "hf")
    run = launch(single_node(2), tmp_path / "hf", tokenizer_path, tmp_path / "out")
    assert run.returncodes == [0], run.stderrs[0]
    ranks = run.results(2)
    for rank in ranks:  # the same slice as the native 2-shard Meta layout, bit for bit
        assert rank["weights"] == expected_digests("gqa", 2)[rank["rank"]], f"rank {rank['rank']}"
    assert ranks[0]["greedy"] == reference("gqa")["greedy"]
    assert_only_rank0_printed(run)


def test_two_nodes(checkpoint, reference, tokenizer_path, tmp_path):
    run = launch(two_nodes(), checkpoint("gqa", 2), tokenizer_path, tmp_path / "out")
    assert run.returncodes == [0, 0], run.stderrs
    ranks = run.results(2)
    assert ranks[0]["greedy"] == reference("gqa")["greedy"]
    assert "Loaded in" in run.stdouts[0]
    assert "Loaded in" not in run.stdouts[1] and " -> " not in run.stdouts[1], run.stdouts[1]
    assert_only_rank0_printed(run)


# Faults: a failing rank must not leave the others waiting ------------------------------------------------------


@pytest.fixture(scope="module")
def broken_checkpoints(checkpoint, tmp_path_factory) -> Dict[str, Path]:
    """The 2-shard gqa checkpoint with consolidated.01.pth missing, or cut short (not a zip file any more)."""
    source = checkpoint("gqa", 2)
    broken = {}
    for kind in ("missing", "truncated"):
        folder = tmp_path_factory.mktemp(f"broken_{kind}")
        (folder / "params.json").write_bytes((source / "params.json").read_bytes())
        (folder / "consolidated.00.pth").symlink_to(source / "consolidated.00.pth")
        if kind == "truncated":
            (folder / "consolidated.01.pth").write_bytes((source / "consolidated.01.pth").read_bytes()[:1000])
        broken[kind] = folder
    return broken


@pytest.fixture(scope="module")
def faults(checkpoint, broken_checkpoints, tokenizer_path, tmp_path_factory) -> Dict[str, Run]:
    """Each fault's run, by name. The runs go side by side in two groups: much of their time is spent waiting for
    a timeout, and starting up (most of the rest) must not crowd a launch past its deadline.
    - "one torchrun: raise" and "one torchrun: missing": one torchrun of two processes, where rank 1 raises after
      build (rank 0 is then in generate's all-reduce) or finds its shard missing (a shape error while loading),
      with a collective timeout (AGENT_ONLY_TIMEOUT) past the run's deadline: only torchrun's agent can end rank 0.
    - "two nodes: hang", "two nodes: raise", "two nodes: truncated": two single-process nodes, where node 1 hangs
      or raises after build, or cannot read its shard (and so never joins the process group), and only its own
      collectives (timeout FAULT_TIMEOUT) can end node 0; a hung node 1 is stopped once node 0 is done.
    """
    folder, ckpt = tmp_path_factory.mktemp("faults"), checkpoint("gqa", 2)
    pinned = {"LLAMA_CPU_KERNEL": "linear"}  # a fault does not depend on the kernels: none are measured
    ways = {"raise": ["--fail", "raise"], "hang": ["--fail", "hang"]}
    ways.update({kind: ["--fail-ckpt-dir", path] for kind, path in broken_checkpoints.items()})
    # Per run: what launches it (two_nodes picks its port as it is called), the worker's arguments, `wait_for`.
    one_torchrun = {
        f"one torchrun: {fault}": (lambda: single_node(2), [*ways[fault], "--timeout", AGENT_ONLY_TIMEOUT], None)
        for fault in ("raise", "missing")
    }
    nodes = {
        f"two nodes: {fault}": (
            two_nodes,
            [*ways[fault], "--timeout", FAULT_TIMEOUT],
            [0] if fault == "hang" else [0, 1],
        )
        for fault in ("hang", "raise", "truncated")
    }
    results = {}
    for group in (one_torchrun, nodes):
        started = []
        for name, (commands, args, wait_for) in group.items():
            out = folder / name.replace(": ", "-").replace(" ", "_")
            started.append(start(commands(), ckpt, tokenizer_path, out, *args, wait_for=wait_for, **pinned))
        results.update(zip(group, finish(*started)))
    return results


@pytest.mark.parametrize("fault", ["raise", "missing"])
def test_failing_rank_stops_torchrun(fault, faults):
    """Torchrun's agent ends rank 0 and exits non-zero, with rank 1's error. Rank 0's own collectives would wait
    AGENT_ONLY_TIMEOUT, past the run's deadline, where `finish` fails the run: the agent ended it."""
    run = faults[f"one torchrun: {fault}"]
    assert run.returncodes[0] != 0
    assert ("fails on purpose" if fault == "raise" else "has shape") in run.stderrs[0], run.stderrs[0][-3000:]


@pytest.mark.parametrize("fault", ["hang", "raise", "truncated"])
def test_survivor_gives_up_on_lost_node(fault, faults):
    """Node 0 fails within FAULT_TIMEOUT + SLACK of losing node 1, with an error that says why."""
    run = faults[f"two nodes: {fault}"]
    assert run.returncodes[0] != 0, run.stderrs[0]
    failed_at_file = Path(f"{run.out_prefix}.rank1.failed_at")
    lost_at = float(failed_at_file.read_text()) if failed_at_file.exists() else run.ended[1]
    took = run.ended[0] - lost_at
    assert took < FAULT_TIMEOUT + SLACK, (
        f"node 0 gave up {took:.0f} s after node 1 was lost, its timeout {FAULT_TIMEOUT} s"
    )
    if fault == "hang":  # only the all-reduce's timeout can have ended it
        assert "timed out" in run.stderrs[0].lower(), run.stderrs[0][-3000:]
    if fault == "truncated":  # node 0 waited for node 1 to join the group, up to the timeout
        assert "timeout" in run.stderrs[0].lower(), run.stderrs[0][-3000:]


def test_a_gguf_file_is_sliced_per_rank(checkpoint, reference, tokenizer_path, tmp_path):
    """Each process reads its slice of an F32 GGUF: the native 2-shard layout's weights, bit for bit (a 4-bit file's
    int4 slices: tests/test_gguf.py)."""
    from llama.checkpoint.convert import to_gguf

    to_gguf(checkpoint("gqa", 1), tmp_path / "gqa.gguf", "F32")
    run = launch(single_node(2), tmp_path / "gqa.gguf", tokenizer_path, tmp_path / "out")
    assert run.returncodes == [0], run.stderrs[0]
    ranks = run.results(2)
    for rank in ranks:
        assert rank["weights"] == expected_digests("gqa", 2)[rank["rank"]], f"rank {rank['rank']}"
    assert ranks[0]["greedy"] == reference("gqa")["greedy"]
