"""One step of the engine (`engine`) as every process runs it: the `Plan` that rank 0 makes, its broadcast to
the other processes of a torchrun job (`PlanChannel`, `follow_plans`), and `run_plan`, which runs it on the model:
copies between cache rows, one decode step over the rows, then prompt chunks, each in its own row. It records what
the decode step writes in the cache (`RuntimeTransformer.cached`; `forward` and `copy_cached` record their own).
"""

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from llama.runtime import DecodeStep, RuntimeTransformer
from llama.vision.batch import ImageTiles

# A server idles between requests for as long as it likes: the plan broadcast gets its own, patient group.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass
class Plan:
    """One step's work for the model, the same in every process. Rows beyond the decode lists, and rows of the
    decode lists with nothing to decode, compute nothing anyone reads (see `Engine.plan`)."""

    decode_tokens: List[int] = field(default_factory=list)  # one per row 0..n-1 (empty: no decode step)
    decode_positions: List[int] = field(default_factory=list)
    decode_rows: List[int] = field(default_factory=list)  # those of rows 0..n-1 whose logits are wanted
    # (row, start position, prompt chunk, whether the logits of every position are wanted or only the last's)
    prefills: List[Tuple[int, int, List[int], bool]] = field(default_factory=list)
    # A vision model's (row, prompt, images): the images a row's new prompt sees (none: a row freed, or a prompt of
    # text only), encoded for the row before anything else runs.
    images: List[Tuple[int, List[int], List[ImageTiles]]] = field(default_factory=list)
    # (source row, target row, start, end): positions [start, end) copied between rows, before anything else runs
    copies: List[Tuple[int, int, int, int]] = field(default_factory=list)
    stop: bool = False  # the server is shutting down: followers return


@torch.inference_mode()
def run_plan(
    model: RuntimeTransformer, decode_step: Optional[DecodeStep], plan: Plan
) -> Tuple[Dict[int, torch.Tensor], List[torch.Tensor]]:
    """Run one step: a vision model's images for new rows, the copies between cache rows, the decode rows (through
    `decode_step`; None: eagerly), then the prompt chunks. Returns the next-token logits (vocab_size,) of each of
    plan.decode_rows, by row, and the last logits of each chunk ((len(chunk), vocab_size) where the plan wants every
    position's)."""
    device = model.tok_embeddings.weight.device
    decode_logits, prefill_logits = {}, []
    for row, prompt, images in plan.images:
        model.show_row_images(row, prompt, images)
    for source, target, start, end in plan.copies:
        model.copy_cached(source, target, start, end)
    if len(plan.decode_rows) == 1 and decode_step is None:
        # One request decoding alone, eagerly: the step Llama.generate takes (`forward` from an int position), so
        # that its tokens are generate's in every dtype. The batched step rounds otherwise in bfloat16.
        (row,) = plan.decode_rows
        token = torch.tensor([[plan.decode_tokens[row]]], dtype=torch.long, device=device)  # (1, 1)
        logits = model.forward(token, plan.decode_positions[row], last_logits_only=True, first_row=row)
        decode_logits[row] = logits[0, -1]
    elif plan.decode_rows:
        tokens = torch.tensor(plan.decode_tokens, dtype=torch.long, device=device)[:, None]  # (n, 1)
        positions = torch.tensor(plan.decode_positions, dtype=torch.long, device=device)  # (n,)
        logits = (decode_step or model.decode_step)(tokens, positions)[:, -1]
        decode_logits = {i: logits[i] for i in plan.decode_rows}  # views: no copy of the (n, vocab_size) logits
        for row, (token, position) in enumerate(zip(plan.decode_tokens, plan.decode_positions)):
            model.cached.wrote(row, position, [token])
    for row, start, chunk, every_position in plan.prefills:
        # After the decode step, whose write at this row's position (an input nobody reads) this chunk overwrites.
        tokens = torch.tensor([chunk], dtype=torch.long, device=device)  # (1, len(chunk))
        logits = model.forward(tokens, start, last_logits_only=not every_position, first_row=row)[0]
        prefill_logits.append(logits if every_position else logits[-1])
    return decode_logits, prefill_logits


class PlanChannel:
    """Rank 0's plans, broadcast to every process of the torchrun job."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, plan: Plan) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.group)

    def receive(self) -> Plan:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def follow_plans(model: RuntimeTransformer, decode_step: Optional[DecodeStep], channel: PlanChannel) -> None:
    """Run rank 0's plans in this process until it sends the stop."""
    while not (plan := channel.receive()).stop:
        run_plan(model, decode_step, plan)
