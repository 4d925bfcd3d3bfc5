"""What this CPU is (`cpu_name`, `cpu_flags`, `last_level_cache_bytes`) and what measuring its kernels found
(`Measured`), kept between loads in `KernelCache`."""

import contextlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import torch
import torch.distributed as dist

from llama.distributed import several_processes
from llama.runtime.cpu.kernels import ATTENTION_KERNELS, KERNELS
from llama.runtime.quantized import QUANTIZED_PRODUCTS

try:
    import fcntl
except ImportError:  # Windows: no lock, so concurrent first loads there measure each for itself
    fcntl = None

logger = logging.getLogger(__name__)

# Seconds a load waits for another process of this machine to finish measuring its kernels (`measuring_alone`);
# then it measures for itself. Measuring takes seconds at 1B, and longer for larger models.
LOCK_WAIT = 600


def last_level_cache_bytes() -> int:
    """The size of the CPU's largest data cache (Linux's sysfs), or 32 MiB where it is not known."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip().upper()
                sizes.append(int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]] if size[-1] in "KM" else int(size))
        except (OSError, ValueError):
            continue
    return min(max(sizes, default=32 * 2**20), 512 * 2**20)


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (a virtual machine may name
    only the vendor's line, "AMD EPYC")."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    numbers = [f"{key} {fields[key]}" for key in ("cpu family", "model") if key in fields]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def cpu_flags() -> List[str]:
    """Which of the instruction sets that decide the kernels' speed this CPU has."""
    flags = set(cpuinfo_fields().get("flags", "").split())
    wanted = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    found = [flag for flag in wanted if flag in flags]
    return found or [f"torch: {torch.backends.cpu.get_cpu_capability()}"]


# Environment variables that cap the instructions torch's kernel libraries use (ATen, oneDNN under either name,
# fbgemm, MKL): with them set to AVX2 an AVX-512 CPU runs the kernels an AVX2 CPU runs.
INSTRUCTION_CAPS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "MKL_ENABLE_INSTRUCTIONS",
)


def instruction_caps() -> List[str]:
    """The caps of `INSTRUCTION_CAPS` set here, as NAME=value."""
    return [f"{name}={os.environ[name]}" for name in INSTRUCTION_CAPS if os.environ.get(name)]


def cpuinfo_fields() -> Dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()))


@dataclass
class Measured:
    """What measuring one product at one row count found, in seconds per weight of the sample it ran on: each
    kernel's fastest and median timed round, and for "fp16" the time it takes to make the float16 copy at load, for
    the int8 "split" product fbgemm's packed copy (fbgemm packs a weight on one core, and a load packs on as many
    threads as torch uses: each copy's time is divided by that)."""

    seconds: Dict[str, float]
    median: Dict[str, float]
    fp16_copy: Optional[float] = None
    split_copy: Optional[float] = None
    # Whether its rounds disagreed even when timed again (`llama.runtime.cpu.choice.NOISE`): a busy machine's figures,
    # cached all the same (with a warning); the next process's first load re-checks them.
    noisy: bool = False
    # Whether a later load's re-check found these figures still hold (`llama.runtime.cpu.choice.cached_timings_stale`):
    # then no load re-checks them again.
    confirmed: bool = False

    def fastest(self, leave_out: str = "") -> str:
        """The kernel (but `leave_out`) of the shortest median round."""
        return min((kernel for kernel in self.median if kernel != leave_out), key=self.median.get)


COPIES = ("fp16_copy", "split_copy")  # the `Measured` fields a cache entry may hold beside the timings


def cache_folder() -> Path:
    """Where `KernelCache` keeps its file: $XDG_CACHE_HOME/llama3, or ~/.cache/llama3."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "llama3"


@contextlib.contextmanager
def measuring_alone() -> Iterator[None]:
    """Hold this machine's kernel-measuring lock (a lock file beside the `KernelCache` file) for the block: a
    process whose load starts while another measures waits, then reads what that one measured. So loads started
    together choose alike, as later ones will, and none times its kernels while another's take the cores. Ranks of
    one model-parallel job do not take it: they measure together, as they will decode, and run rank 0's figures
    (`KernelCache.agree`). Where the folder cannot be written or locked (or after `LOCK_WAIT`), the block runs
    without the lock."""
    lock = None
    if fcntl is not None and not several_processes():
        lock = locked_file(cache_folder() / "kernels.lock")
    try:
        yield
    finally:
        if lock is not None:
            lock.close()  # which releases it


def locked_file(path: Path):
    """`path` opened and locked for this process alone (waiting up to `LOCK_WAIT` for another to let it go), or None
    where it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "w")
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_WAIT
    waiting = False
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return file
        except BlockingIOError:
            if time.monotonic() > deadline:
                logger.warning(
                    "Waited %d s for another process measuring this CPU's kernels: measuring here", LOCK_WAIT
                )
                break
            if not waiting:
                logger.info("Another process is measuring this CPU's kernels (%s): waiting for its figures", path)
                waiting = True
            time.sleep(0.05)
        except OSError:  # a file system without locks
            break
    file.close()
    return None


class KernelCache:
    """What measuring found here (`Measured`), in `$XDG_CACHE_HOME/llama3/kernels.json` (or
    ~/.cache/llama3/kernels.json), keyed by the CPU, its flags (and `instruction_caps`), the torch version, the
    thread count, the product, the rows and the candidates: a later load on the same CPU with the same torch
    chooses from it without measuring, so that it runs the same kernels and gives the same results (the kernels of
    a product round its sums in different orders).

    Every measurement is kept, a busy machine's too; the one time an entry is replaced is when a later process's
    first load finds it measured on a busier machine (`llama.runtime.cpu.choice.cached_timings_stale`, `forget`).
    What a process measured or read stays in `IN_PROCESS`, so that every load in the process chooses alike, even
    where the file cannot be written. A file that cannot be read, or holds anything else, is ignored (the kernels
    are measured again and the file rewritten); one that cannot be written is skipped.

    Under model parallelism every rank measures its own shard of each product (the same shapes on every rank), on
    its own cores; then every rank runs what rank 0 found, and keeps that in its file (`agree`): a first load runs
    what every later one reads, on every rank, whether the ranks share a file or each node has its own."""

    FORMAT = 4  # 4: one-row and batch timings on samples of up to 2**24 weights (2**22 before)
    # Entries measured or read in this process, by cache file: they win over what the file holds now.
    IN_PROCESS: Dict[Path, Dict[str, dict]] = {}

    def __init__(self):
        self.path = cache_folder() / "kernels.json"
        flags = " ".join(cpu_flags() + instruction_caps())
        self.machine = f"{cpu_name()} [{flags}], torch {torch.__version__}, {torch.get_num_threads()} threads"
        self.seen = self.IN_PROCESS.setdefault(self.path, {})
        self.entries = {**self.read(), **self.seen}
        self.measured = {}
        self.forgotten = set()

    def read(self) -> Dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("Ignoring the CPU kernel cache %s, which cannot be read (%s): measuring again", self.path, e)
            return {}
        if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] < self.FORMAT:
            logger.info("The CPU kernel cache %s was written by an older version: measuring again", self.path)
            return {}
        entries = data.get("measured") if isinstance(data, dict) and data.get("format") == self.FORMAT else None
        if not isinstance(entries, dict) or not all(map(self.valid, entries.values())):
            logger.warning("Ignoring the CPU kernel cache %s, which holds something else: measuring again", self.path)
            return {}
        return entries

    @staticmethod
    def valid(entry) -> bool:
        """Whether `entry` is what `put` writes: each kernel's fastest and median round (the same kernels), and
        perhaps a copy's time, each a finite number of seconds."""
        if not isinstance(entry, dict) or set(entry) - {"seconds", "median", *COPIES, "confirmed"}:
            return False
        if entry.get("confirmed", False) is not True and "confirmed" in entry:
            return False
        seconds, median = entry.get("seconds"), entry.get("median")
        if not (isinstance(seconds, dict) and isinstance(median, dict) and seconds):
            return False
        figures = [*seconds.values(), *median.values(), *(entry.get(copy, 0.0) for copy in COPIES)]
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in figures)
        known = {*KERNELS, *QUANTIZED_PRODUCTS, *ATTENTION_KERNELS}
        return numbers and set(seconds) == set(median) and set(seconds) <= known

    def key(self, product: str, rows: int, candidates: List[str]) -> str:
        return f"{self.machine} | {product} | {rows} rows | {' '.join(candidates)}"

    def get(self, key: str) -> Optional[Measured]:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.seen[key] = entry
        copies = {copy: entry[copy] for copy in COPIES if copy in entry}
        return Measured(entry["seconds"], entry["median"], **copies, confirmed="confirmed" in entry)

    def used_in_this_process(self) -> Set[str]:
        """The keys whose entries a load of this process has measured or read so far."""
        return set(self.seen)

    def forget(self, keys: List[str]) -> None:
        """Drop `keys`' entries, which no longer hold on this machine: `save` writes what is measured in their place."""
        for key in keys:
            self.entries.pop(key, None)
            self.measured.pop(key, None)
            self.seen.pop(key, None)
        self.forgotten.update(keys)

    def put(self, key: str, measured: Measured) -> None:
        entry = {"seconds": measured.seconds, "median": measured.median}
        entry.update({copy: getattr(measured, copy) for copy in COPIES if getattr(measured, copy) is not None})
        if measured.confirmed:
            entry["confirmed"] = True
        self.entries[key] = self.measured[key] = self.seen[key] = entry

    def agree(self, keys: Set[str]) -> Set[str]:
        """Under model parallelism (a process group of more than one), take rank 0's entries for `keys` in place of
        this rank's (a collective: every rank calls it at the same point of a load). Returns the keys whose
        entries changed here. Each rank's timings differ a little; were each to choose from its own, the ranks of a
        first load could run other kernels than the ones the file keeps for later loads. A rank on another kind of
        machine (another node) has keys of its own, and keeps its entries."""
        if not several_processes():
            return set()
        shared = [{key: self.entries.get(key) for key in sorted(keys)}]
        dist.broadcast_object_list(shared, src=0)
        changed = set()
        for key, entry in shared[0].items():
            if key in keys and entry is not None and entry != self.entries.get(key):
                self.entries[key] = self.seen[key] = self.measured[key] = entry
                changed.add(key)
        return changed

    def save(self) -> None:
        """Write what was measured since this cache was read, with what the file holds now (another process may
        have added its own) but the forgotten entries, replacing the file in one step."""
        if not self.measured and not self.forgotten:
            return
        kept = {key: entry for key, entry in self.read().items() if key not in self.forgotten}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"format": self.FORMAT, "measured": {**kept, **self.measured}}, indent=1)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as file:
                file.write(text)
            os.replace(file.name, self.path)
        except OSError as e:
            logger.warning("Could not write the CPU kernel cache %s (%s): the next load measures again", self.path, e)
