"""The chaos-gen guest: a generator that echoes words, or misbehaves on request (tests)."""

from __future__ import annotations

from collections.abc import Iterator

import meshfn_sdk


class ChaosGen(meshfn_sdk.Model):
    def count_tokens(self, prompt: str) -> int:
        return len(prompt.split())  # this model's tokens are words

    def generate(self, prompt: str, settings: meshfn_sdk.Settings) -> Iterator[str]:
        words = prompt.split() or ["..."]
        mode = words[0]
        if mode == "refuse":
            raise meshfn_sdk.BadRequest("chaos-gen refuses this prompt")
        if mode == "count":
            for i in range(1, settings.max_tokens + 1):
                yield f"{i} "
            return "length"
        if mode == "slow":  # "slow N word...": each piece after N loop iterations of work
            spin = int(words[1]) if len(words) > 1 and words[1].isdigit() else 100_000
            for i in range(settings.max_tokens):
                for _ in range(spin):
                    pass
                yield f"{words[2 + i % max(1, len(words) - 2)] if len(words) > 2 else i} "
            return "length"
        for i, word in enumerate(words * 4):
            if i == 2 and mode == "spin":
                while True:
                    pass
            if i == 2 and mode == "trap":
                raise RuntimeError("chaos-gen failed mid-stream")
            yield word + " "
        return None


MODEL = ChaosGen()
