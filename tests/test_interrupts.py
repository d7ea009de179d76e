"""Ctrl-C at every instruction of the code that lends a model or a thread some state (the attention switch, held
products, the products a thread multiplies by, `ProductsMode` on its mode stack, transformers' capturing hooks) and of
the code around it: afterwards the models, the thread and the process are as before, and the next call's output is.

The sweep traces those functions instruction by instruction (`sys.settrace`) and runs the SIGINT handler at the n-th
point where Python checks for signals (as it would for a Ctrl-C that arrived just before), for every such point a call
reaches."""

import _thread
import dis
import signal
import sys
import types

import pytest
import torch
from test_model_is_sacred import assert_same, state
from tiny_models import PROMPTS, make_drafter, make_target
from torch.overrides import _get_current_function_mode_stack

import hf_eagle31
from hf_eagle31 import features, generation, interrupts
from hf_eagle31.backends import cpu as cpu_backend
from hf_eagle31.backends.cpu import lean
from hf_eagle31.backends.cpu import products as cpu_products
from hf_eagle31.interrupts import Held

NEW = 3


def _codes(*functions) -> set[types.CodeType]:
    """The code objects of `functions` and of every function defined inside them (closures)."""
    found, stack = set(), [f.__code__ for f in functions]
    while stack:
        code = stack.pop()
        found.add(code)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


# where state is made or undone, and the functions whose `with` blocks hold it
SWEPT = _codes(Held.__enter__, Held.__exit__, Held._hold, Held._release, Held._handler, interrupts._deliver,
               generation.eagle_verification, generation._switch_back, generation.fast_decoding,
               cpu_products.hold_products, cpu_products.products_for, cpu_products._activation,
               cpu_products.Products.active, cpu_products.products_mode, features.capturing_hooked,
               features.remove_capturing_hooks, cpu_backend.CpuBackend.target_forwards, lean.llama_verify_forward,
               torch.overrides.TorchFunctionMode.__enter__, torch.overrides.TorchFunctionMode.__exit__)
SWEPT |= {getattr(generation.GenerationMixin, "_assisted_decoding").__code__}


CALLS_OPS = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "BEFORE_WITH")}


def _checks(code: types.CodeType) -> set[int]:
    """The offsets in `code` at which Python may run a signal handler (its "eval breaker" checks): a frame's first
    instruction, a backward jump, and every call (whose callee checks as it starts, or which checks after calling
    into C)."""
    return {instruction.offset for instruction in dis.get_instructions(code)
            if instruction.opcode in CALLS_OPS or instruction.opname == "RESUME" or
            instruction.opname.startswith("JUMP_BACKWARD")}


CHECKS = {code: _checks(code) for code in SWEPT}


class Sweep:
    """A tracer that runs the SIGINT handler where Python would for a signal arriving just before the `at`-th check
    point of `SWEPT` a call reaches, listing them in the order it first reaches them (`points`; a point reached again,
    in a later forward, is the same point). At a call the handler runs as the callee starts, in its frame (or, for a
    function in C, at the next instruction); a handler that raises raises there."""

    def __init__(self, at: int):
        self.at, self.points, self.armed = at, {}, False

    def fire(self, frame) -> None:
        self.armed = False
        signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)

    def __call__(self, frame, event, arg):
        if event == "call" and self.armed:
            self.fire(frame)
        if event == "call" and frame.f_code in SWEPT:
            frame.f_trace_opcodes = True
            return self.local
        return None

    def local(self, frame, event, arg):
        if event != "opcode":
            return self.local
        if self.armed:
            self.fire(frame)
        point = frame.f_code, frame.f_lasti
        if point[1] in CHECKS[point[0]] and point not in self.points:
            self.points[point] = None
            if len(self.points) == self.at:
                if frame.f_code.co_code[frame.f_lasti] in CALLS_OPS:
                    self.armed = True
                else:
                    self.fire(frame)
        return self.local


def swept(call, at: int) -> tuple[int, bool]:
    """`call()` with a SIGINT at its `at`-th check point: how many points it reached, and whether it was
    interrupted."""
    tracer = Sweep(at)
    sys.settrace(tracer)
    try:
        call()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
    return len(tracer.points), interrupted


def thread_as_before() -> None:
    assert _get_current_function_mode_stack() == []
    assert getattr(cpu_products._ACTIVE, "products", None) is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert generation._VERIFYING == {} and len(cpu_products._HELD) == 0


def trains(target) -> bool:
    """Every linear layer gets a gradient (a `ProductsMode` left on the stack would compute without one)."""
    target.zero_grad()
    target.train()
    try:
        target(PROMPTS[:1, :6], labels=PROMPTS[:1, :6]).loss.backward()
    finally:
        target.eval()
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    ok = all(m.weight.grad is not None for m in linears)
    target.zero_grad(set_to_none=True)
    return ok


CALLS = {
    "eagle": lambda t, d: t.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=NEW, assistant_model=d),
    "fast_decoding": lambda t, d: t.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=NEW,
                                             custom_generate=hf_eagle31.fast_decoding),
    "hold_products": lambda t, d: _in_blocks(t, d),
}


def _in_blocks(target, drafter):
    with hf_eagle31.hold_products(target), hf_eagle31.hold_products(drafter):
        return CALLS["eagle"](target, drafter)


@pytest.mark.slow
@pytest.mark.parametrize("call, dtype", [("fast_decoding", torch.float32), ("hold_products", torch.bfloat16)])
def test_a_ctrl_c_at_any_instruction_leaves_models_thread_and_next_call_as_before(call, dtype):
    if dtype == torch.bfloat16 and not hf_eagle31.backends.fast_bf16(torch.device("cpu")):
        pytest.skip("bf16 runs on the CPU backend only where oneDNN computes it")
    target = make_target(seed=7, dtype=dtype)
    drafter = make_drafter(target)
    drafter.generation_config.update(speculation_mode="tree", collapse_fallback=False)
    run = CALLS[call]
    expected, before, drafter_before = run(target, drafter), state(target), state(drafter)
    total, interrupted = swept(lambda: run(target, drafter), at=0)
    assert total > 50 and not interrupted
    hits = 0
    for at in range(1, total + 1):
        _, interrupted = swept(lambda: run(target, drafter), at)
        hits += interrupted
        assert_same(target, before)
        assert_same(drafter, drafter_before)
        thread_as_before()
        assert trains(target), at
        if at % 16 == 0:  # the state checked above is what the next call runs on: its output, now and then
            assert torch.equal(run(target, drafter), expected), at
    assert torch.equal(run(target, drafter), expected)
    assert hits > total // 2


def test_sigint_during_a_change_goes_to_the_users_handler_once_it_is_whole():
    """(Before: a user's SIGINT handler, or SIG_IGN, was replaced by a KeyboardInterrupt during the switch.)"""
    seen, applied = [], []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(len(applied)))
    try:
        def apply():
            _thread.interrupt_main()  # arrives while the change is made: waits for it
            applied.append(1)
            applied.append(2)

        with Held(apply, applied.clear):
            assert seen == [2]  # the user's handler ran once the change was whole, and no KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with Held(apply, applied.clear):
            pass
        assert applied == [] and seen == [2]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupted_change_is_undone_before_the_interrupt_is_raised():
    log = []

    def apply():
        log.append("applied")
        _thread.interrupt_main()
        log.append("whole")

    with pytest.raises(KeyboardInterrupt):
        with Held(apply, lambda: log.append("undone")):
            log.append("body")  # never reached
    assert log == ["applied", "whole", "undone"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
