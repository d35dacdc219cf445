"""Conversations to tokens: chat templates, labels on assistant turns, placeholder expansion.

A sample's text is a list of turns (``human`` / ``gpt``). The template renders each turn as
pieces that are tokenized separately and concatenated, so the assistant's tokens (its
content and end marker) are known exactly and carry the labels; nothing else does. Each
occurrence of an encoder's placeholder becomes exactly that encoder's rows per image of
image positions (token id: the placeholder's own token, else pad, else eos: mimo.data.tokenizer; the
LLM replaces them with image rows).

Which image file feeds which encoder (several encoders, docs/design.md §2) follows from the counts of
placeholders in the text, for a sample with N image files (ordered ``png``/``0.png``, ``1.png``, ...):

* every encoder's placeholder occurs N times: each image feeds every encoder (one picture seen
  by several towers, e.g. at two resolutions); the i-th occurrence of each takes image i;
* the placeholders occur N times in all: each image feeds one encoder; the i-th placeholder
  occurrence in the text, whichever encoder's, takes image i ("<image> ... <sketch>" with two
  files: the first to the image tower, the second to the sketch tower);
* anything else is a DataError naming the counts (the sample is listed as bad).

With one encoder the two rules coincide; with several they cannot both hold unless N = 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from mimo.core.errors import DataError
from mimo.data.native_images import NativePlaceholder
from mimo.data.tokenizer import facts_of, load_tokenizer, special_ids, tokenizer_problems

TEMPLATES = ("plain", "vicuna", "chatml", "tokenizer")  # tokenizer: its own chat_template
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


@dataclass(frozen=True)
class Turn:
    role: str  # "human" or "gpt"
    text: str


@dataclass
class TokenizedSample:
    tokens: list[int]
    target: list[bool]  # True where the token is an assistant token (a label to predict)
    image_starts: dict[str, list[int]] = field(default_factory=dict)  # placeholder -> first position of each image
    image_files: dict[str, list[int]] = field(default_factory=dict)  # placeholder -> the image file of each of them
    image_rows: dict[str, list[int]] = field(default_factory=dict)  # native placeholder -> rows of each of its images
    # native placeholder -> where each of its image slots comes from: (VIDEO, video file, temporal
    # patch) for a video's temporal patches (each its own slot), (IMAGE, image file, 0) else
    slot_files: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


def turns_from_json(obj) -> list[Turn]:
    """LLaVA's ``{"conversations": [{"from": "human", "value": ...}, ...]}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list) or not obj["conversations"]:
        raise DataError("missing key: 'conversations' (a non-empty list)")
    turns = []
    for i, t in enumerate(obj["conversations"]):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str) or t.get("from") not in ("human", "user", "gpt", "assistant"):
            raise DataError(f"missing key: conversations[{i}] needs 'from' (human/gpt) and a string 'value'")
        role = "human" if t["from"] in ("human", "user") else "gpt"
        if role == "gpt" and not t["value"].strip():
            raise DataError(f"empty answer: conversations[{i}] is an assistant turn with no text")
        turns.append(Turn(role, t["value"]))
    if not any(t.role == "gpt" for t in turns):
        raise DataError("no assistant turn: nothing to learn")
    return turns


def turns_from_caption(caption: str, placeholders: Sequence[str], images: int, videos: int = 0,
                       video_placeholder: str = "") -> list[Turn]:
    """An image-caption pair as one exchange: the images (then the videos), then the caption as
    the answer."""
    if not caption.strip():
        raise DataError("empty caption: the txt file has no text")
    prompt = "".join(f"{p}\n" for _ in range(images) for p in placeholders) + f"{video_placeholder}\n" * videos
    return [Turn("human", prompt), Turn("gpt", caption.strip())]


class Template:
    """Renders turns as (text, is_target) pieces. ``tokenizer``: the tokenizer's own chat
    template; its ``{% generation %}`` blocks are the targets (mimo.data.tokenizer checks it)."""

    def __init__(self, name: str, eos: str, tokenizer=None):
        if name not in TEMPLATES:
            raise DataError(f"unknown template {name!r}")
        self.name, self.eos, self.tokenizer = name, eos, tokenizer
        self._list_content = False  # the chat template wants content as a list of parts (found on first use)

    def pieces(self, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
        if self.name == "tokenizer":
            return self._chat_template_pieces(turns)
        out: list[tuple[str, bool]] = []
        if self.name == "vicuna":
            out.append((VICUNA_SYSTEM, False))
        for t in turns:
            if self.name == "plain":
                out.append((t.text, False) if t.role == "human" else (t.text + self.eos, True))
            elif self.name == "vicuna":
                out += [(" USER: " + t.text, False)] if t.role == "human" else [(" ASSISTANT:", False), (" " + t.text + self.eos, True)]
            else:  # chatml
                if t.role == "human":
                    out.append(("<|im_start|>user\n" + t.text + "<|im_end|>\n", False))
                else:
                    out += [("<|im_start|>assistant\n", False), (t.text + "<|im_end|>", True), ("\n", False)]
        return out

    def answer_end(self) -> str:
        """The text that ends an assistant answer (where greedy generation stops): chatml's
        ``<|im_end|>``, the eos token for plain / vicuna, and for ``tokenizer`` what its
        generation block renders after the answer's own text ("" if nothing)."""
        if self.name == "chatml":
            return "<|im_end|>"
        if self.name != "tokenizer":
            return self.eos
        probe = "\x00answer\x00"  # text no template adds: what follows it in the span is the end marker
        for piece, target in self._chat_template_pieces([Turn("human", "q"), Turn("gpt", probe)]):
            if target and probe in piece:
                return piece.split(probe, 1)[1]
        return ""

    def _chat_template_pieces(self, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
        """What ``apply_chat_template(..., return_assistant_tokens_mask=True)`` renders, cut at its
        generation spans (the tokenizer's special tokens are the template's variables, as there)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        tok = self.tokenizer
        errors = []
        for list_content in (self._list_content, not self._list_content):
            messages = [{"role": "user" if t.role == "human" else "assistant",
                         "content": [{"type": "text", "text": t.text}] if list_content else t.text} for t in turns]
            try:
                rendered, spans = render_jinja_template([messages], chat_template=tok.chat_template,
                                                        return_assistant_tokens_mask=True, **tok.special_tokens_map)
            except Exception as e:  # noqa: BLE001 - jinja raises many kinds; the sample is reported bad
                errors.append(f"{type(e).__name__}: {e}")
                continue
            self._list_content = list_content
            text, out, at = rendered[0], [], 0
            for start, stop in spans[0]:
                out += [(text[at:start], False), (text[start:stop], True)]
                at = stop
            out.append((text[at:], False))
            if not any(target and piece for piece, target in out):
                raise DataError("empty answer: the chat template marked no assistant text ({% generation %})")
            return [(piece, target) for piece, target in out if piece]
        raise DataError(f"chat template failed: {errors[0]}")


class TextEncoder:
    """Tokenizer + template + placeholders -> TokenizedSample."""

    def __init__(self, tokenizer, template: str, rows_per_image: dict[str, int], native: Sequence[NativePlaceholder] = ()):
        facts = facts_of(tokenizer)
        problems = tokenizer_problems(facts, template, list(rows_per_image))
        if problems:  # check-config reports these first; here for callers that skip it
            raise DataError("; ".join(problems))
        ids, _ = special_ids(facts, list(rows_per_image))
        self.tok = tokenizer
        self.template = Template(template, tokenizer.eos_token or "", tokenizer)
        self.rows_per_image = dict(rows_per_image)
        self.native = {n.placeholder: n for n in native}  # placeholders whose rows follow each image's grid
        # a video placeholder -> the native tower that takes videos (one at most: mimo.compose.config)
        self.video_of = {n.video_placeholder: n for n in native if n.video is not None}
        self.image_tokens, self.pad_id = ids.image, ids.pad
        # a chat template writes its own bos (HF's apply_chat_template adds no special tokens)
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and template != "tokenizer" else []
        names = sorted([*self.rows_per_image, *self.video_of], key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(p) for p in names) + ")") if names else None

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts in one call (no special tokens added)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: skip the per-call Python overhead
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def encode(self, turns: Sequence[Turn], images: int, file_rows: dict[str, Sequence[int]] | None = None,
               videos: Sequence = ()) -> TokenizedSample:
        """DataError when the placeholders do not match the image files (module doc).
        ``file_rows``: per native placeholder, the rows of each image file (its grid's); an
        occurrence of it becomes the vision start text, the rows of the file it takes, the
        vision end text (``NativePlaceholder``). ``videos``: the ``VideoLayout`` of each video
        file; the i-th occurrence of a video placeholder takes the i-th video, which becomes per
        temporal patch its timestamp text, the vision start text, its rows, the vision end text
        (``mimo.data.native_video``): one image slot of the tower each."""
        parts: list[tuple[str, bool]] = []
        for text, is_target in self.template.pieces(turns):
            split = self._split.split(text) if self._split is not None and not is_target else [text]
            parts += [(p, is_target) for p in split if p]
        occurrences: dict[str, list[int]] = {p: [] for p in self.rows_per_image}  # index among all placeholders
        seen = 0
        for part, _ in parts:
            if part in self.rows_per_image:
                occurrences[part].append(seen)
                seen += 1
        files = image_files(occurrences, images)
        n_videos = sum(part in self.video_of for part, _ in parts)
        if n_videos != len(videos):
            raise DataError(f"{COUNTS_DIFFER}: {n_videos} x {next(iter(self.video_of), '<video>')!r} for "
                            f"{len(videos)} video(s); each video needs one")
        marks = [m for n in self.native.values() for m in (n.vision_start, n.vision_end) if m]
        stamps = [s for v in videos for s in v.stamps]
        texts = [p for p, _ in parts if p not in self.rows_per_image and p not in self.video_of] + stamps + marks
        ids = self.ids(texts) if texts else []
        mark_ids = dict(zip(marks, ids[len(ids) - len(marks):]))
        stamp_ids = iter(ids[len(ids) - len(marks) - len(stamps): len(ids) - len(marks)])
        ids = iter(ids[: len(ids) - len(marks) - len(stamps)])
        tokens, target = list(self.bos), [False] * len(self.bos)
        starts: dict[str, list[int]] = {p: [] for p in self.rows_per_image}
        rows_of: dict[str, list[int]] = {p: [] for p in self.native}
        slots: dict[str, list[tuple[str, int, int]]] = {p: [] for p in self.native}

        def slot(placeholder: str, n: int, lead=(), tail=()) -> None:
            tokens.extend(lead)
            starts[placeholder].append(len(tokens))
            tokens.extend([self.image_tokens[placeholder]] * n)
            tokens.extend(tail)
            target.extend([False] * (len(lead) + n + len(tail)))

        video = 0
        for part, is_target in parts:
            native = self.native.get(part) or self.video_of.get(part)
            if native is not None:
                lead, tail = mark_ids.get(native.vision_start, []), mark_ids.get(native.vision_end, [])
            if part in self.video_of:
                layout = videos[video]
                n = native.rows(layout.grids[0])
                for t in range(len(layout.stamps)):
                    stamp = next(stamp_ids)
                    tokens.extend(stamp)
                    target.extend([False] * len(stamp))
                    slot(native.placeholder, n, lead, tail)
                    rows_of[native.placeholder].append(n)
                    slots[native.placeholder].append((VIDEO, video, t))
                video += 1
            elif native is not None:
                file = files[part][sum(kind == IMAGE for kind, _, _ in slots[part])]
                known = (file_rows or {}).get(part, ())
                if file >= len(known):
                    raise DataError(f"no image grid for image file {file} of placeholder {part!r}")
                rows_of[part].append(known[file])
                slots[part].append((IMAGE, file, 0))
                slot(part, known[file], lead, tail)
            elif part in self.rows_per_image:
                slot(part, self.rows_per_image[part])
            else:
                piece = next(ids)
                tokens += piece
                target += [is_target] * len(piece)
        return TokenizedSample(tokens, target, starts, files, rows_of, slots)


IMAGE, VIDEO = "image", "video"
COUNTS_DIFFER = "placeholder and image counts differ"  # the reason (kind) of a sample whose counts fit neither rule


def image_files(occurrences: dict[str, list[int]], images: int) -> dict[str, list[int]]:
    """Placeholder -> the image file each of its occurrences takes (module doc), from each
    placeholder's occurrence indices among all placeholders of the text."""
    counts = {p: len(v) for p, v in occurrences.items()}
    if all(n == images for n in counts.values()):  # every image feeds every encoder
        return {p: list(range(images)) for p in counts}
    if sum(counts.values()) == images:  # each image feeds the encoder whose placeholder takes it
        return {p: list(v) for p, v in occurrences.items()}
    found = ", ".join(f"{n} x {p!r}" for p, n in counts.items())
    raise DataError(f"{COUNTS_DIFFER}: {found} for {images} image(s); each placeholder needs one "
                    f"per image (shared images) or all placeholders together one per image (one encoder each)")


LABEL_OPEN, LABEL_CLOSE = "[[", "]]"


def show_sample(tokens: list[int], target: list[bool], image_starts: dict[str, list[int]], rows_per_image: dict[str, int],
                decode, image_rows: dict[str, list[int]] | None = None) -> str:
    """A sample as a person reads it: the decoded text with ``[[...]]`` around the label tokens
    (the ones the loss predicts) and ``{<image> x N}`` for the N image positions of each image
    (``image_rows``: each image's own N, native placeholders)."""
    image_rows = image_rows or {}
    image_at = {s: (p, image_rows[p][k] if p in image_rows else rows_per_image[p])
                for p, starts in image_starts.items() for k, s in enumerate(starts)}
    out, run, flag, i = [], [], False, 0

    def flush():
        if run:
            text = decode(run)
            out.append(f"{LABEL_OPEN}{text}{LABEL_CLOSE}" if flag else text)
            run.clear()

    while i < len(tokens):
        if i in image_at:
            flush()
            p, n = image_at[i]
            out.append(f"{{{p} x {n}}}")
            i += n
            continue
        if target[i] != flag:
            flush()
            flag = target[i]
        run.append(tokens[i])
        i += 1
    flush()
    return "".join(out)


def true_runs(flags: Sequence[bool]) -> list[list[int]]:
    """[start, stop) of each run of True: [F, T, T, F, T] -> [[1, 3], [4, 5]]."""
    runs: list[list[int]] = []
    for i, f in enumerate(flags):
        if f and runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        elif f:
            runs.append([i, i + 1])
    return runs
