"""The unsharded shape of every tensor of a Llama 3.2 Vision checkpoint in Meta's layout, for random weights (the
tests, a demo) and checks."""

from typing import Dict, Tuple

from llama.checkpoint.shards import full_shapes
from llama.model import ModelArgs
from llama.vision.encoder import MAX_TILES, EncoderArgs
from llama.vision.model import LEARNABLE_EMBEDDINGS, VisionArgs, fusion_schedule


def encoder_shapes(args: EncoderArgs, text_dim: int) -> Dict[str, Tuple[int, ...]]:
    """`vision_model`'s tensors (without the prefix)."""
    width, tokens, hidden = args.width, args.tokens_per_tile, 4 * args.width
    shapes = {
        "vision_encoder.conv1._linear.weight": (width, 3 * args.patch_size**2),
        "vision_encoder.class_embedding": (width,),
        "vision_encoder.positional_embedding": (tokens, width),
        "vision_encoder.gated_positional_embedding": (MAX_TILES, MAX_TILES, tokens, width),
        "vision_encoder.gated_positional_embedding_gate": (1,),
    }
    for name in ("ln_pre", "ln_post"):
        shapes.update({f"vision_encoder.{name}.weight": (width,), f"vision_encoder.{name}.bias": (width,)})
    for stack, layers in (("transformer", args.layers), ("global_transformer", args.global_layers)):
        for i in range(layers):
            block = f"vision_encoder.{stack}.resblocks.{i}"
            shapes.update({f"{block}.attn.{w}.weight": (width, width) for w in ("wq", "wk", "wv", "wo")})
            shapes.update(
                {
                    f"{block}.mlp.c_fc.weight": (hidden, width),
                    f"{block}.mlp.c_fc.bias": (hidden,),
                    f"{block}.mlp.c_proj.weight": (width, hidden),
                    f"{block}.mlp.c_proj.bias": (width,),
                }
            )
            for name in ("ln_1", "ln_2"):
                shapes.update({f"{block}.{name}.weight": (width,), f"{block}.{name}.bias": (width,)})
            if stack == "global_transformer":
                shapes.update({f"{block}.gate_attn": (1,), f"{block}.gate_ffn": (1,)})
    for name in ("pre_tile_pos_embed", "post_tile_pos_embed"):
        shapes.update(
            {f"vision_encoder.{name}.embedding": (MAX_TILES, MAX_TILES, 1, width), f"vision_encoder.{name}.gate": (1,)}
        )
    shapes.update({"vision_projection.weight": (text_dim, args.feature_dim), "vision_projection.bias": (text_dim,)})
    return shapes


def cross_attention_shapes(args: ModelArgs, block: int) -> Dict[str, Tuple[int, ...]]:
    """One cross-attention block's tensors (under `text_model.cross_attention_layers.{block}`)."""
    dim, kv_dim, hidden, head_dim = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim, args.head_dim
    prefix = f"text_model.cross_attention_layers.{block}"
    return {
        f"{prefix}.attention.wq.weight": (dim, dim),
        f"{prefix}.attention.wk.weight": (kv_dim, dim),
        f"{prefix}.attention.wv.weight": (kv_dim, dim),
        f"{prefix}.attention.wo.weight": (dim, dim),
        f"{prefix}.attention.q_norm.weight": (head_dim,),
        f"{prefix}.attention.k_norm.weight": (head_dim,),
        f"{prefix}.attention_norm.weight": (dim,),
        f"{prefix}.gate_attn": (1,),
        f"{prefix}.feed_forward.w1.weight": (hidden, dim),
        f"{prefix}.feed_forward.w2.weight": (dim, hidden),
        f"{prefix}.feed_forward.w3.weight": (hidden, dim),
        f"{prefix}.ffn_norm.weight": (dim,),
        f"{prefix}.gate_ffwd": (1,),
    }


def full_vision_shapes(args: ModelArgs, vision: VisionArgs) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of a vision checkpoint: the vision model's, then the text model's (the text layers' keys of a
    text checkpoint under `text_model.`, the image-token embedding, the cross-attention blocks)."""
    shapes = {f"vision_model.{key}": shape for key, shape in encoder_shapes(vision.encoder, args.dim).items()}
    shapes.update({f"text_model.{key}": shape for key, shape in full_shapes(args).items()})
    shapes["text_model.learnable_embedding.weight"] = (LEARNABLE_EMBEDDINGS, args.dim)
    for block in range(len(fusion_schedule(args.n_layers, vision.cross_attention_layers))):
        shapes.update(cross_attention_shapes(args, block))
    return shapes
