"""The one exception type users see: its message is printed as a single line, never a traceback. Also which other
exceptions mean memory ran out (torch-free: `fafo list` and `--help` never load torch)."""

import errno
import sys


def print_notice(message: str) -> None:
    """A one-line notice on standard error: what a caller of the Python API may take instead (`notify`)."""
    print(f"note: {message}", file=sys.stderr, flush=True)


class FafoError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ModelOutputError(FafoError):
    """The model computes no numbers here (its logits overflowed: float16 on a model that needs more range): the
    setup's fault, not a request's (the server answers 500, not 400)."""


# Ctrl-Cs the CLI's SIGINT handler turned into KeyboardInterrupt that no command has handled: an interrupt that lands
# inside a module's import can surface later as another error (numpy: "cannot load module more than once"), which
# the CLI then reports as the interrupt (cli.entrypoint)
unhandled_interrupts: list[int] = []


def interrupt_handled() -> None:
    """A command caught the Ctrl-C and went on (a chat answer stopped, a bench cut short): errors after it are
    its own, not an interrupt's leftovers."""
    unhandled_interrupts.clear()


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` means memory ran out: MemoryError; torch.OutOfMemoryError (CUDA, MPS), matched by name; the
    RuntimeError of torch's CPU allocator ("DefaultCPUAllocator: not enough memory: you tried to allocate ...") or of
    cuBLAS on a full GPU (CUBLAS_STATUS_ALLOC_FAILED, as a worker thread makes its handle); the system's ENOMEM (a
    process that could not start, a file that could not be mapped)."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and says_out_of_memory(str(error))


def says_out_of_memory(text: str) -> bool:
    """Whether an error's text says memory ran out: torch's allocators ("out of memory", "not enough memory: you
    tried to allocate"), the system's ("Cannot allocate memory"), a compiler the kernel killed ("Killed signal"), or
    a MemoryError named in another process's last line (a building process's)."""
    text = text.lower()
    return ("out of memory" in text or ("alloc" in text and "memory" in text) or "killed signal" in text
            or "memoryerror" in text or "status_alloc_failed" in text)


def first_line(what: BaseException | str, *, named: bool = False) -> str:
    """An error's message (or a text) cut to its first line, at most 300 characters (a compiler's or the hub's
    first line can run on); an error without a message gives its type's name. `named`: "TypeError: message"."""
    text = str(what).strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(what, BaseException) and (named or not line):
        line = f"{type(what).__name__}: {line}" if line else type(what).__name__
    return line[:300]


def shortened(text: str, most: int) -> str:
    """A user's text for a one-line message: its first line, at most `most` characters, with "…" where any of it
    was cut (a prompt given as text, a value of thousands of digits)."""
    text = text.strip()
    line = text.splitlines()[0] if text else ""
    return line if line == text and len(line) <= most else line[:most].rstrip() + "…"
