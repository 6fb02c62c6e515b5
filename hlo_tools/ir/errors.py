"""Errors raised by hlo_tools: the only exception types its parser and verifier let escape."""


class HloError(Exception):
    """Base of the errors this package raises for bad HLO."""


class HloParseError(HloError):
    """Text that is not valid HLO. `line` and `column` are 1-based."""

    def __init__(self, message: str, line: int = 1, column: int = 1):
        self.message = message
        self.line = line
        self.column = column
        super().__init__(f"{line}:{column}: {message}")


class HloVerifyError(HloError):
    """A module that parses but breaks one of XLA's structural or shape rules."""

    def __init__(self, message: str, line: int | None = None, instruction: str | None = None):
        self.message = message
        self.line = line
        self.instruction = instruction
        where = f"{line}: " if line else ""
        who = f"{instruction}: " if instruction else ""
        super().__init__(f"{where}{who}{message}")


def one_line(message: str) -> str:
    """The first non-blank line of ``message`` (error output is one line per failure)."""
    for line in message.splitlines():
        if line.strip():
            return line.strip()
    return ""
