"""Generation's work below `Llama`: the reference's batch decoder (`batch`), what it shares with the server's engine
(`next_token`: grammar masks, stops, logprobs), Meta's nucleus sampling (`sampling`), decoding under a grammar
(`grammar`), speculative decoding's proposer and acceptance rules (`speculative`) and the speed of an answer
(`speed`). Tokens in, tokens out: text is `llama.text`'s."""

from llama.decoding.batch import BatchDecoder, NewTokens
from llama.decoding.speed import Speed, Stopwatch

__all__ = ["BatchDecoder", "NewTokens", "Speed", "Stopwatch"]
