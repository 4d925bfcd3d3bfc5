"""Which copies of the weights a load makes: a kernel that reads a copy of its own (the float16 copy of a bfloat16
or float32 weight, fbgemm's copy of an int8 one for the "split" product) runs only where the time it saves over one
full context repays the time the copy takes to make (docs/speed.md, "How the CPU kernels are chosen")."""

from typing import Collection, Dict, List, Optional

from llama.runtime.cpu.cache import Measured


def calls_per_context(rows: int, max_seq_len: int, decode_counts: Collection[int]) -> float:
    """How many products of `rows` rows one full context takes: a decode step per position where a decode step runs
    the kernel chosen for `rows` (`rows` in `decode_counts`: one sequence, the batch, a verification), else prompts
    of `rows` tokens filling it."""
    return max_seq_len if rows in decode_counts else max_seq_len / rows


def repaid_copies(
    measured: Dict[int, Measured], max_seq_len: int, kernel: str, making: float, decode_counts: Collection[int]
) -> Dict[int, str]:
    """The fastest of `measured`'s kernels for each row count, but `kernel`, which reads a copy of the weights that
    takes `making` seconds per weight to make, only where the time it would save over one full context at a row
    count it wins (`calls_per_context`) exceeds that: elsewhere the fastest of the others."""
    chosen = {rows: m.fastest() for rows, m in measured.items()}
    wins = [rows for rows, fastest in chosen.items() if fastest == kernel]
    if wins and copy_saving(measured, wins, max_seq_len, kernel, decode_counts) < making:
        chosen = {rows: m.fastest(leave_out=kernel) for rows, m in measured.items()}
    return chosen


def copy_saving(
    measured: Dict[int, Measured], wins: List[int], max_seq_len: int, kernel: str, decode_counts: Collection[int]
) -> float:
    """The most a copy read by `kernel` saves per weight over one full context at one of the row counts `wins` it
    wins, counted from its median timed round against the other kernels' fastest: a lead smaller than the spread of
    the timings is no lead."""
    return max(
        (m.seconds[m.fastest(leave_out=kernel)] - m.median[kernel])
        * calls_per_context(rows, max_seq_len, decode_counts)
        for rows, m in measured.items()
        if rows in wins
    )


def declined_copy(
    measured: Dict[int, Measured],
    chosen: Dict[int, str],
    kernel: str,
    making: float,
    max_seq_len: int,
    decode_counts: Collection[int],
    weights: int,
) -> Optional[str]:
    """Why `kernel`'s copy of `weights` weights (`making` seconds a weight to make) is not made, for the load's log:
    where `kernel` measured fastest at some row count but `chosen` (`repaid_copies`) runs another there. None where it
    was never fastest, or its copy is made."""
    declined = [rows for rows, m in measured.items() if m.fastest() == kernel and chosen[rows] != kernel]
    if not declined:
        return None
    saving = max(0.0, copy_saving(measured, declined, max_seq_len, kernel, decode_counts)) * weights
    return (
        f"fastest for {', '.join(map(str, declined))} rows, but making it ({making * weights:.3g} s) would take longer "
        f"than it saves over a full context of {max_seq_len} tokens ({saving:.3g} s)"
    )
