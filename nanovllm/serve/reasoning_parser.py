"""`--reasoning-parser qwen3|deepseek_r1`: a reasoning model's `<think>...</think>` block becomes
`reasoning_content`, the rest `content`. Fed the output's text as it arrives, so a tag may come
split over several pieces; text that may be the start of a tag waits for the next piece.

qwen3: an output that opens with `<think>` reasons until `</think>`; any other output is all content
(with `enable_thinking: false` the template closes the block in the prompt). deepseek_r1: everything
before `</think>` is reasoning, whether or not the output opens with the tag (its template writes it
into the prompt); an output that never closes the block is all reasoning.
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
    OPENING, THINKING, AFTER = "opening", "thinking", "after"

    def __init__(self, thinks_without_tag: bool):
        self.thinks_without_tag = thinks_without_tag    # an output not opening with <think> reasons anyway
        self.state = self.OPENING
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of text settles."""
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == self.OPENING:
                if len(self.pending) < len(THINK_START) and THINK_START.startswith(self.pending):
                    break
                opened = self.pending.startswith(THINK_START)
                if opened:
                    self.pending = self.pending[len(THINK_START):]
                self.state = self.THINKING if opened or self.thinks_without_tag else self.AFTER
            elif self.state == self.THINKING:
                found = self.pending.find(THINK_END)
                if found < 0:
                    settled = len(self.pending) - partial_tag_length(self.pending, THINK_END)
                    reasoning.append(self.pending[:settled])
                    self.pending = self.pending[settled:]
                    break
                reasoning.append(self.pending[:found])
                self.pending = self.pending[found + len(THINK_END):]
                self.state = self.AFTER
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output: it was no tag after all."""
        rest, self.pending = self.pending, ""
        thinking = self.state == self.THINKING or (self.state == self.OPENING and self.thinks_without_tag)
        return (rest, "") if thinking else ("", rest)


def qwen3() -> ReasoningParser:
    return ReasoningParser(thinks_without_tag=False)


def deepseek_r1() -> ReasoningParser:
    return ReasoningParser(thinks_without_tag=True)


REASONING_PARSERS = {"qwen3": qwen3, "deepseek_r1": deepseek_r1}
