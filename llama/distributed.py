"""Where the model runs: device and dtype choice, and the process group for model parallelism.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; the device index comes from the local rank (the GPU on this
node) and the checkpoint slice from the model-parallel rank. Without torchrun, a one-process group is made.
Every process computes the same tokens; the library prints nothing on stdout (it logs), and leaves the other
ranks' stdout alone (the example scripts silence it).
"""

import atexit
import logging
import os
from datetime import timedelta
from typing import Optional, Union

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist

from llama.logs import stdout_to_log
from llama.os_memory import available_memory

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """The device to run on: `device` if it is available, else CUDA when present, else the CPU.

    Raises:
        ValueError: when the requested device is unknown or not available on this machine.
    """
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", gpu_index_of_this_process(None))
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"Unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available here; use device='cpu'")
        return torch.device("cuda", gpu_index_of_this_process(device.index))
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("device 'mps' was requested but this PyTorch build or machine has no MPS support")
        return device
    if device.type != "cpu":
        raise ValueError(f"Unsupported device {str(device)!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return device


def gpu_index_of_this_process(index: Optional[int]) -> int:
    """The GPU this process runs on: `index`, or else the process's local rank (torchrun starts one per GPU).

    Raises:
        ValueError: when that GPU is not visible, naming the fix (fewer processes, or the CPU).
    """
    count = torch.cuda.device_count()
    if index is not None:
        if index >= count:
            raise ValueError(f"cuda:{index} was requested but only {count} GPU(s) are visible")
        return index
    if local_rank() >= count:
        raise ValueError(
            f"This is process {local_rank()} on this node, but only {count} GPU(s) are visible, and each process "
            f"needs a GPU of its own: start at most {count} (torchrun --nproc_per_node {count}), or run on the "
            "CPU (device='cpu', --device cpu)"
        )
    return local_rank()


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """`dtype`, or the default for the device: bfloat16 on CUDA when supported, else float16; float32 on CPU."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"Unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if str(dtype).lower() not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[str(dtype).lower()]


def init_model_parallel(device: torch.device, model_parallel_size: Optional[int], timeout: timedelta) -> int:
    """Join (or create) the process group and fairscale's model-parallel groups; returns the MP size.

    A collective in any of these groups fails after `timeout`, so a process whose peer died or hangs raises
    instead of waiting forever.

    Raises:
        ValueError: when model_parallel_size does not match the processes torchrun started.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any NCCL group exists, so that each binds to this GPU
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # plain `python script.py`: a group of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        # Ended as the process ends: an NCCL group left to the interpreter's teardown warns on stderr.
        atexit.register(destroy_process_group)
    world_size = dist.get_world_size()
    if model_parallel_size is None:
        model_parallel_size = world_size
    if not fs_init.model_parallel_is_initialized():
        if model_parallel_size < 1 or world_size % model_parallel_size:
            raise ValueError(
                f"model_parallel_size={model_parallel_size} does not divide the {world_size} processes started; "
                f"start {model_parallel_size} processes (torchrun --nproc_per_node {model_parallel_size})"
            )
        with stdout_to_log(logger):  # fairscale prints its "> initializing ..." lines
            fs_init.initialize_model_parallel(model_parallel_size)
        # fairscale makes its groups with torch's default timeout (30 minutes for gloo, 10 for NCCL), and the
        # model's all-reduces run in them: give them ours, or a rank would wait that long for a dead peer.
        # (newer torch releases name _set_pg_timeout publicly: torch.distributed.set_timeout.)
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        for group in (
            fs_init.get_model_parallel_group(),
            fs_init.get_data_parallel_group(),
            fs_init.get_pipeline_parallel_group(),
        ):
            set_timeout(timeout, group)
    elif fs_init.get_model_parallel_world_size() != model_parallel_size:
        raise ValueError(
            f"Model parallelism is already set up with size {fs_init.get_model_parallel_world_size()}, "
            f"not {model_parallel_size}"
        )
    return model_parallel_size


def destroy_process_group() -> None:
    """Destroy the default process group and fairscale's, where they still exist."""
    if dist.is_initialized():
        dist.destroy_process_group()


def several_processes() -> bool:
    """Whether this process is one rank of several in a process group (torchrun, model parallelism)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ranks_on_this_machine() -> int:
    """How many processes of this job run on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without it): they share
    its memory."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes this process can still allocate on `device`, or None where that is not known: on a GPU what it has
    free, on the CPU this process's share of what the system has available (`ranks_on_this_machine`)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_memory() // ranks_on_this_machine() or None
    return None
