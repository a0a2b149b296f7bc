"""`--reasoning-parser qwen3|deepseek_r1`: a reasoning model's `<think>...</think>` block becomes
`reasoning_content`, the rest `content`. Fed the output's text as it arrives, so a tag may come
split over several pieces; text that may be the start of a tag waits for the next piece.

qwen3: only a block the model opens with `<think>` is reasoning (with `enable_thinking: false` the
template closes the block in the prompt, and the output has none). deepseek_r1: everything before
`</think>` is reasoning, whether or not the model wrote the opening tag (its template writes it into
the prompt); an output that never closes the block is all reasoning.
"""
THINK_START, THINK_END = "<think>", "</think>"


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of text could be the start of tag (held back until more text comes)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningParser:
    """One output's text, split into (reasoning, content) piece by piece."""
    BEFORE, THINKING, AFTER = "before", "thinking", "after"

    def __init__(self, starts_thinking: bool):
        self.state = self.THINKING if starts_thinking else self.BEFORE
        self.may_open = starts_thinking     # an opening tag at the very start is dropped
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of text settles."""
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == self.AFTER:
                content.append(self.pending)
                self.pending = ""
            elif self.may_open:
                if len(self.pending) < len(THINK_START) and THINK_START.startswith(self.pending):
                    break
                if self.pending.startswith(THINK_START):
                    self.pending = self.pending[len(THINK_START):]
                self.may_open = False
            else:
                tag = THINK_START if self.state == self.BEFORE else THINK_END
                out = content if self.state == self.BEFORE else reasoning
                found = self.pending.find(tag)
                if found < 0:
                    settled = len(self.pending) - partial_tag_length(self.pending, tag)
                    out.append(self.pending[:settled])
                    self.pending = self.pending[settled:]
                    break
                out.append(self.pending[:found])
                self.pending = self.pending[found + len(tag):]
                self.state = self.THINKING if self.state == self.BEFORE else self.AFTER
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output: it was no tag after all."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == self.THINKING else ("", rest)


def qwen3() -> ReasoningParser:
    return ReasoningParser(starts_thinking=False)


def deepseek_r1() -> ReasoningParser:
    return ReasoningParser(starts_thinking=True)


REASONING_PARSERS = {"qwen3": qwen3, "deepseek_r1": deepseek_r1}
