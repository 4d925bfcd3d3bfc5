"""The operating system's memory, as the loader and the runtime ask it: how much the system can hand out
(`available_memory`), freed memory handed back (`release_freed_memory`, glibc's malloc_trim) and a file's mapped
pages dropped from this process (`forget_file_pages`, madvise over the ranges /proc/self/maps lists). Linux's calls;
elsewhere each does nothing, or says it does not know."""

import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple


def available_memory() -> int:
    """Bytes the system can hand out without swapping: Linux's MemAvailable, which counts reclaimable page cache
    such as mmap-ed checkpoint pages; 0 where it is not known, so that nothing extra is allocated there."""
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


@functools.cache
def glibc_function(name: str) -> Optional[Callable]:
    """The C library's function `name` where that library is glibc's (Linux), else None."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the system, where the C library is glibc's (Linux). glibc keeps freed
    blocks of a few MB for reuse; while a load makes each layer through temporaries between the layers it keeps,
    those kept blocks grow the process by hundreds of MB that it never uses again. Elsewhere the allocator is left
    to itself."""
    malloc_trim = glibc_function("malloc_trim")
    if malloc_trim:
        malloc_trim(0)


MADV_DONTNEED = 4  # Linux's madvise advice: drop the range's pages from this process


def file_mappings(is_wanted: Callable[[str], bool]) -> List[Tuple[int, int]]:
    """The address ranges [start, end) of this process's mappings of the files whose path `is_wanted` (Linux's
    /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:  # "start-end perms offset dev inode path"
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and is_wanted(fields[5].rstrip("\n")):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def forget_file_pages(paths: Iterable[Path]) -> None:
    """Drop this process's resident pages of its mappings of the files at `paths` (Linux; nothing elsewhere): they
    stop counting in its memory, and a later read maps them again from the file (or the system's page cache). Only
    for files mapped read-only or copy-on-write and never written through the mapping: a private mapping's written
    pages would go back to the file's contents."""
    madvise = glibc_function("madvise") if os.uname().sysname == "Linux" else None
    if not madvise:
        return
    files = {os.path.realpath(path) for path in paths}
    for start, end in file_mappings(files.__contains__):
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
