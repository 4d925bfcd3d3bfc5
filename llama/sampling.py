"""Choosing each next token from the model's logits: Meta's nucleus sampling (`sample_top_p`), greedy decoding,
and the CPU's shortcut to the same draws."""

# The sampling defaults of Meta's `text_completion` and `chat_completion`, used wherever a caller may leave them out.
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.9
