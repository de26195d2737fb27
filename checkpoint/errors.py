"""The one error type the checkpoint layer raises: every message names a file or tensor and
says what to do about it."""


class CheckpointError(Exception):
    """A checkpoint (or a draft source, or an option) that tandem refuses.

    `problems` holds one self-contained message per problem found; str() joins them.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems) if len(self.problems) > 1
                         else self.problems[0])
