"""The OpenAI-compatible HTTP server (docs/serve.md): `llama serve`, `python -m llama.serve`.

One concern a module, from the wire inwards:
- `app`: the HTTP app (FastAPI routes, authentication, error bodies) over a `Service`;
- `protocol`: OpenAI's and vLLM's request shapes, checked as they arrive, and the shapes of their answers' parts;
- `serving`: requests turned into engine work (prompts, dialogs, grammars) and the engine's outputs into answers,
  whole or streamed;
- `engine` and `engine_plan`: continuous batching over the rows of the KV cache, and the step plan every process
  runs under torchrun;
- `main`: the command line, which loads the checkpoint and starts the server.
"""

from llama.serve.main import main

__all__ = ["main"]
