"""CPU synchronization checks: a stage's scheduling code, run on the CPU, replayed in a model of Hopper's rules.

A barrier, wait-group or pipeline mistake gives no wrong number on the CPU: the kernel
hangs, races or just loses its overlap on the GPU. These checks catch such mistakes
without one, in two steps.

1. Record. The stage's own Python (the learner's ping-pong functions and overlapped step,
   the solution's loops around them) runs as plain Python, once per MMA warpgroup, with
   recording stand-ins for what it calls: named barriers (``cute.arch.barrier``,
   ``barrier_arrive``), WGMMA issue (``warpgroup_gemm``: one committed group) and
   ``warpgroup.wait_group``, the pipelines' ``consumer_wait`` / ``consumer_release``, and
   the register work between them (softmax, masking, ``rP.store``, ``rescale_rows``). Each
   event keeps the line of the stage file that caused it.
2. Replay. The recorded programs of the warpgroups run together in a small model of the
   hardware rules:

   - a named barrier completes a phase when ``number_of_threads`` threads have arrived
     (128 per warpgroup, ``bar.sync`` or ``bar.arrive``); every participant of a phase
     must name the same count; a phase that completes with nobody waiting in it (two
     arrivals for one wait) hands a turn to no one;
   - ``wait_group(n)`` returns once at most ``n`` of the warpgroup's committed WGMMA
     groups are in flight; registers that an in-flight group reads (its A operand) or
     accumulates into are not touched until a wait covers it;
   - a K or V buffer is read by a GEMM only after ``consumer_wait`` and released once,
     after the GEMMs reading it completed;
   - the ping-pong: between its wait for the turn and passing it, a warpgroup holds the
     turn; no two hold it at once, and the overlapped step issues its GEMMs in its turn;
   - the overlapped step's softmax runs while its ``P V`` GEMM is still in flight (else
     nothing overlaps it);
   - every warpgroup finishes: if all that are left wait on barriers nobody will reach,
     the kernel hangs.

The first broken rule fails the check with the offending line and what to look for.
"""

from __future__ import annotations

import __future__
import ast
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

WARPGROUP_THREADS = 128


class SyncError(AssertionError):
    """A broken synchronization rule, said in the course's words, with the stage file's line."""


class MissingStandIn(SyncError):
    """The scheduling code calls something the CPU model has no stand-in for."""


# ---------------------------------------------------------------- recording

@dataclass
class Event:
    kind: str
    line: int
    args: dict = field(default_factory=dict)


class Recorder:
    """The events of one warpgroup's run, each with the line of ``path`` that caused it."""

    def __init__(self, path: str):
        self.path = path
        self.events: list[Event] = []
        self.context: list[str] = []  # the stage functions being run (overlapped_step, ...)

    def line(self) -> int:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == self.path:
                return frame.f_lineno
            frame = frame.f_back
        return 0

    def add(self, kind: str, **args):
        self.events.append(Event(kind, self.line(), {**args, "in": tuple(self.context)}))


class Registers:
    """A register fragment (S, P, O): what GEMMs read and accumulate into and what the softmax touches."""

    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name
        self.element_type = "fp16"

    def load(self):
        self.rec.add("read", regs=self)
        return _Loaded()

    def store(self, _value):
        self.rec.add("write", regs=self)

    def fill(self, _value):
        self.rec.add("write", regs=self)


class _Loaded:
    def to(self, _dtype):
        return self


class SharedOperand:
    """A GEMM's B operand in shared memory: tSrK / tOrV, one ring buffer per index of the last mode."""

    def __init__(self, pipe: str):
        self.pipe = pipe

    def __getitem__(self, key):
        return Buffer(self.pipe, key[-1])


@dataclass(frozen=True)
class Buffer:
    pipe: str
    index: int


class State:
    """A pipeline state: the ring index and how many tiles it has passed."""

    def __init__(self, stages: int):
        self.stages, self.count = stages, 0

    @property
    def index(self) -> int:
        return self.count % self.stages

    def advance(self):
        self.count += 1


class Pipeline:
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def consumer_wait(self, state: State):
        self.rec.add("wait", buffer=Buffer(self.name, state.index), tile=state.count)

    def consumer_release(self, state: State):
        self.rec.add("release", buffer=Buffer(self.name, state.index))


class Mask:
    """The window of a Q tile whose loops run masked, unmasked and masked steps (each loop at least once)."""

    def __init__(self, rec: Recorder, masked_end: int, unmasked_end: int):
        self.rec, self.ends = rec, (masked_end, unmasked_end)

    def kv_block(self, i, _lo, _hi):
        return i

    def unmasked_steps(self, _lo, _hi):
        return self.ends

    def tile_is_partial(self, _n_block):
        return True

    changes_full_tiles = False

    def apply(self, acc_S, _coords, _n_block):
        self.rec.add("write", regs=acc_S)

    apply_full = apply


class Strict:
    """A namespace whose unknown attributes name themselves instead of silently doing nothing."""

    def __init__(self, rec: Recorder, label: str, **members):
        self._rec, self._label = rec, label
        self.__dict__.update(members)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingStandIn(f"{_where(self._rec.path, self._rec.line())}: the CPU synchronization check has no "
                             f"stand-in for {self._label}.{name}: "
                             "the scheduling code may use named barriers, warpgroup_gemm, warpgroup.wait_group "
                             "and the pipelines' consumer_wait / consumer_release")


def _range(*args, unroll=None, **_):
    return range(*(int(a) for a in args))


def stand_ins(rec: Recorder) -> dict:
    """Names the scheduling code uses, as recording stand-ins."""

    def barrier(*, barrier_id, number_of_threads):
        rec.add("bar.sync", id=int(barrier_id), count=int(number_of_threads))

    def barrier_arrive(*, barrier_id, number_of_threads):
        rec.add("bar.arrive", id=int(barrier_id), count=int(number_of_threads))

    def warpgroup_gemm(_mma, acc, a, b, zero_init=True):
        reads = [x for x in (a, b) if isinstance(x, (Registers, Buffer))]
        rec.add("gemm", acc=acc, reads=reads, accumulate=not zero_init)

    def wait_group(n):
        rec.add("wait_group", n=int(n))

    def softmax_step(acc_S, row_max, row_sum, row_scale, scale_log2, first, tight):
        rec.add("softmax", regs=acc_S)

    def rescale_rows(acc_O, _row_scale):
        rec.add("write", regs=acc_O)

    def online_softmax(acc_S, acc_O, *_):
        rec.add("softmax", regs=acc_S)
        rec.add("write", regs=acc_O)

    def make_rmem_tensor_like(like, _dtype=None):
        return Registers(rec, like.name)

    def no_op(*_, **__):
        return None

    arch = Strict(rec, "cute.arch", barrier=barrier, barrier_arrive=barrier_arrive,
                  warp_reduction_max=no_op, warp_reduction_sum=no_op)
    cute = Strict(rec, "cute", arch=arch, make_rmem_tensor_like=make_rmem_tensor_like)
    cutlass = Strict(rec, "cutlass", const_expr=lambda x: x, range=_range, range_constexpr=_range, max=max, min=min,
                     Int32=int, Float32=float, Constexpr=object)
    return dict(cute=cute, cutlass=cutlass, warpgroup=Strict(rec, "warpgroup", wait_group=wait_group),
                warpgroup_gemm=warpgroup_gemm, softmax_step=softmax_step, rescale_rows=rescale_rows,
                online_softmax=online_softmax)


def as_python(module, names: tuple[str, ...], overrides: dict) -> dict:
    """The module's functions ``names`` as plain Python, calling each other and ``overrides`` instead of the DSL
    (``"Class.method"`` names a method, which lands in the scope under its own name, ``self`` its first argument).

    They are compiled afresh from the module's file, without their decorators: once the DSL has
    traced a ``@cute.jit`` function, the function it keeps is its own rewrite of the source (its
    ``if`` and ``for`` become DSL regions), which only runs inside a trace.
    """
    scope = dict(vars(module))
    scope.update(overrides)
    path = inspect.getsourcefile(module)
    tree = ast.parse(Path(path).read_text(), filename=path)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):  # "Class.method": a function of self
        functions.update({f"{cls.name}.{node.name}": node for node in cls.body if isinstance(node, ast.FunctionDef)})
    for name in names:
        node = functions[name]
        node.decorator_list = []
        code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, scope)
    return scope


def traced(rec: Recorder, scope: dict, name: str):
    """``scope[name]`` that also marks its events as made inside ``name``."""
    fn = scope[name]

    def wrapper(*args, **kwargs):
        rec.context.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            rec.context.pop()

    scope[name] = wrapper


# ---------------------------------------------------------------- stage 8: one MMA warpgroup's program

PINGPONG = ("pingpong_start", "pingpong_wait", "pingpong_pass")
STAGE8 = (*PINGPONG, "overlapped_step", "attend_kv_tiles_overlapped", "attend_kv_tiles_pingpong", "tile_scores",
          "mask_scores")


def record_stage8(module, mma_wg: int, *, overlapped: bool, num_wgs: int = 2, q_tiles: int = 2,
                  n_tiles: int = 5, ends: tuple[int, int] = (2, 4)) -> list[Event]:
    """What MMA warpgroup ``mma_wg`` of a stage 8 CTA does for ``q_tiles`` Q tiles of ``n_tiles`` KV tiles:
    the kernel's MMA-warpgroup code with the stage's own functions."""
    rec = Recorder(inspect.getsourcefile(module))
    scope = as_python(module, STAGE8, stand_ins(rec))
    for name in ("overlapped_step", *PINGPONG):
        traced(rec, scope, name)
    acc_S, acc_O, rP = Registers(rec, "S"), Registers(rec, "O"), Registers(rec, "P")
    tSrQ, tSrK, tOrV = Buffer("Q", 0), SharedOperand("K"), SharedOperand("V")
    pipeline_q, pipeline_k, pipeline_v = Pipeline(rec, "Q"), Pipeline(rec, "K"), Pipeline(rec, "V")
    q_state, k_state, v_state = State(1), State(module.KV_STAGES), State(module.KV_STAGES)
    mask = Mask(rec, *ends)
    scope["pingpong_start"](mma_wg)
    for _ in range(q_tiles):
        rec.add("write", regs=acc_O)  # acc_O.fill(0.0)
        pipeline_q.consumer_wait(q_state)
        if overlapped:
            k_state, v_state = scope["attend_kv_tiles_overlapped"](
                None, None, acc_S, acc_O, rP, rP, tSrQ, tSrK, tOrV, pipeline_q, q_state, pipeline_k,
                k_state, pipeline_v, v_state, None, n_tiles, 0, n_tiles, mask, None, None, None, 1.0, mma_wg,
                num_wgs, True)
        else:
            k_state, v_state = scope["attend_kv_tiles_pingpong"](
                None, None, acc_S, acc_O, rP, rP, tSrQ, tSrK, tOrV, pipeline_q, q_state, pipeline_k,
                k_state, pipeline_v, v_state, None, n_tiles, 0, n_tiles, mask, None, None, 1.0, mma_wg, num_wgs)
        q_state.advance()
        rec.add("read", regs=acc_O)  # normalize_rows and the epilogue read O
    return rec.events


# ---------------------------------------------------------------- stage 2: the consumer warpgroup's two passes

STAGE2 = ("tile_scores", "first_pass_row_max", "second_pass_accumulate")


def record_stage2(module, *, n_blocks: int = 3, seqlen_k: int = 300) -> list[Event]:
    """What stage 2's MMA warpgroup does with its K and V buffers: pass 1 over K, pass 2 over K and V."""
    rec = Recorder(inspect.getsourcefile(module))
    acc_S, acc_O = Registers(rec, "S"), Registers(rec, "O")

    def scores_to_operand_a(scores, _dtype):
        rec.add("read", regs=scores)
        return Registers(rec, "P")

    overrides = dict(
        stand_ins(rec), update_row_max=lambda scores, _max: rec.add("read", regs=scores),
        exponentiate_rows=lambda scores, *_: rec.add("softmax", regs=scores),
        mask_keys_beyond=lambda scores, *_: rec.add("write", regs=scores),
        quad_allreduce=lambda *_: None, scores_to_operand_a=scores_to_operand_a)
    scope = as_python(module, STAGE2, overrides)
    tSrQ, tSrK, tOrV = Buffer("Q", 0), SharedOperand("K"), SharedOperand("V")
    pipeline_k, pipeline_v = Pipeline(rec, "K"), Pipeline(rec, "V")
    k_state, v_state = State(module.KV_STAGES), State(module.KV_STAGES)
    rec.add("wait", buffer=tSrQ)  # the Q barrier
    rec.add("write", regs=acc_O)
    k_state = scope["first_pass_row_max"](None, acc_S, tSrQ, tSrK, pipeline_k, k_state, None, n_blocks, seqlen_k, None)
    scope["second_pass_accumulate"](None, None, acc_S, acc_O, tSrQ, tSrK, tOrV, pipeline_k, k_state, pipeline_v,
                                    v_state, None, n_blocks, seqlen_k, None, None, 1.0, None)
    rec.add("read", regs=acc_O)  # normalize_rows and the epilogue
    rec.add("release", buffer=tSrQ)
    return rec.events


def check_stage2(module, n_blocks: int = 3):
    """Stage 2's consumer warpgroup, recorded and replayed; its K and V waits in the producer's order."""
    events = record_stage2(module, n_blocks=n_blocks)
    path = inspect.getsourcefile(module)
    replay({"the MMA warpgroup": events}, path, scheduler_barriers=set(), priority=["the MMA warpgroup"])
    check_tile_order(events, path, {"K": 2 * n_blocks, "V": n_blocks})


def check_tile_order(events: list[Event], path: str, tiles: dict[str, int]) -> None:
    """The consumer waits for each pipeline's tiles in the order the producer fills them (0, 1, 2, ...: the
    pipeline state advanced once per tile), ``tiles[pipe]`` of them."""
    for pipe, count in tiles.items():
        waits = [event for event in events if event.kind == "wait" and event.args["buffer"].pipe == pipe]
        order = [event.args["tile"] for event in waits]
        if order == list(range(count)):
            continue
        wrong = next((i for i, tile in enumerate(order) if tile != i), len(order))
        where = _where(path, waits[wrong].line) if wrong < len(waits) else path
        raise SyncError(f"{where}: the consumer's waits for {pipe} tiles go {order[:8]}{'...' if len(order) > 8 else ''}"
                        f", but the producer fills its {count} tiles in the order 0, 1, 2, ...: a pipeline state that "
                        "is not advanced once per tile (or is advanced twice) waits on a buffer and phase the producer "
                        "never fills, and the kernel hangs")


# ---------------------------------------------------------------- replay in the model

@dataclass
class Group:
    """One committed WGMMA group in flight: what it reads and accumulates into, and where it was issued."""
    acc: Registers
    reads: list
    line: int


@dataclass
class WarpgroupState:
    name: str
    events: list[Event]
    at: int = 0
    groups: list[Group] = field(default_factory=list)
    waited: dict = field(default_factory=dict)  # Buffer -> line of its consumer_wait, until released
    holds_turn: bool = False
    blocked_on: int | None = None  # the barrier id of a bar.sync not yet complete

    @property
    def done(self) -> bool:
        return self.at >= len(self.events)


@dataclass
class BarrierPhase:
    count: int | None = None
    arrived: int = 0
    waiters: list = field(default_factory=list)


def _where(path: str, line: int) -> str:
    return f"{path}:{line}" if line else path


def replay(programs: dict[str, list[Event]], path: str, *, scheduler_barriers: set[int], priority: list[str],
           barrier_names: dict[int, str] | None = None):
    """Run the recorded programs together; raise SyncError at the first broken rule."""
    wgs = {name: WarpgroupState(name, events) for name, events in programs.items()}
    names = barrier_names or {}

    def barrier(bid: int) -> str:
        return f"{names[bid]} (named barrier {bid})" if bid in names else f"named barrier {bid}"
    barriers: dict[int, BarrierPhase] = {}

    def fail(wg: WarpgroupState, event: Event, message: str):
        raise SyncError(f"{wg.name}, {_where(path, event.line)}: {message}")

    first_use: dict[int, tuple] = {}  # barrier id -> (count, line, warpgroup) of its first use
    for wg in wgs.values():
        for event in wg.events:
            if event.kind in ("bar.sync", "bar.arrive"):
                count, line, _ = first_use.setdefault(event.args["id"], (event.args["count"], event.line, wg))
                if event.args["count"] != count:
                    fail(wg, event, f"named barrier {event.args['id']} is used with {event.args['count']} threads "
                                    f"here and {count} at line {line}: every bar.sync and bar.arrive of one barrier "
                                    "must count the same threads (those that wait and those that arrive, together)")

    def in_flight_touching(wg: WarpgroupState, regs: Registers, *, reads_too: bool):
        for g in wg.groups:
            if g.acc is regs or (reads_too and any(r is regs for r in g.reads)):
                return g
        return None

    def arrive(wg, event, bid):
        phase = barriers.setdefault(bid, BarrierPhase())
        phase.count = event.args["count"]
        phase.arrived += WARPGROUP_THREADS
        if phase.arrived > phase.count:
            fail(wg, event, f"named barrier {bid} gets more arrivals than its {phase.count} threads in one phase")
        if phase.arrived == phase.count:
            if not phase.waiters and bid in scheduler_barriers:
                fail(wg, event, f"{barrier(bid)} completed with nobody waiting on it: two arrivals were "
                                "made for one wait, so a turn was handed to no one (and the next wait on it will "
                                "count a phase of its own). Check which barriers pingpong_start arrives on: only "
                                "MMA warpgroup 0's turn is given in advance")
            for waiter in phase.waiters:
                waiter.blocked_on = None
                waiter.holds_turn = waiter.holds_turn or bid in scheduler_barriers
                check_turn(waiter, event)
            barriers[bid] = BarrierPhase()

    def check_turn(wg, event):
        holders = [w.name for w in wgs.values() if w.holds_turn]
        if len(holders) > 1:
            fail(wg, event, f"{' and '.join(holders)} hold the tensor-core turn at the same time: the ping-pong "
                            "lets one warpgroup issue while the other runs its softmax. A turn must be passed "
                            "(bar.arrive on the next warpgroup's barrier) before the next one can take it")

    def step(wg: WarpgroupState) -> bool:
        """Run wg's next event; False if it blocks."""
        if wg.blocked_on is not None:
            return False
        event = wg.events[wg.at]
        kind, a = event.kind, event.args
        if kind == "bar.sync":
            bid = a["id"]
            barriers.setdefault(bid, BarrierPhase()).waiters.append(wg)
            wg.blocked_on = bid
            arrive(wg, event, bid)
            wg.at += 1
            return True
        if kind == "bar.arrive":
            if a["id"] in scheduler_barriers:
                wg.holds_turn = False
            arrive(wg, event, a["id"])
        elif kind == "gemm":
            if "overlapped_step" in a["in"] and scheduler_barriers and not wg.holds_turn:
                fail(wg, event, "this GEMM is issued outside the warpgroup's turn: in the overlapped step both "
                                "GEMMs are issued after pingpong_wait returns and before pingpong_pass")
            for operand in a["reads"]:
                if isinstance(operand, Buffer) and operand not in wg.waited:
                    fail(wg, event, f"the GEMM reads {operand.pipe} buffer {operand.index} without waiting for it "
                                    f"(consumer_wait): the TMA copy may not have landed")
                if isinstance(operand, Registers):
                    g = in_flight_touching(wg, operand, reads_too=False)
                    if g is not None:
                        fail(wg, event, f"the GEMM reads {operand.name} while the GEMM issued at line {g.line} "
                                        f"still writes it: wait for that group first")
            g = in_flight_touching(wg, a["acc"], reads_too=True)
            if g is not None and g.acc is not a["acc"]:
                fail(wg, event, f"the GEMM accumulates into {a['acc'].name} while the GEMM issued at line "
                                f"{g.line} still reads it")
            wg.groups.append(Group(a["acc"], a["reads"], event.line))
        elif kind == "wait_group":
            while len(wg.groups) > a["n"]:
                wg.groups.pop(0)
        elif kind in ("read", "write", "softmax"):
            regs = a["regs"]
            g = in_flight_touching(wg, regs, reads_too=kind != "read")
            if g is not None:
                what = {"read": "reads", "write": "writes", "softmax": "runs the softmax on"}[kind]
                role = "accumulates into" if g.acc is regs else "reads"
                fail(wg, event, f"this line {what} {regs.name} while the WGMMA issued at line {g.line} still "
                                f"{role} it (registers an in-flight WGMMA uses are off limits until a wait_group "
                                "covers it): a race on the GPU, wrong results only sometimes")
            if kind == "softmax" and "overlapped_step" in a["in"] and not wg.groups:
                fail(wg, event, "the softmax runs with no WGMMA in flight: nothing overlaps it. In the overlapped "
                                "step the P V GEMM keeps running during the softmax; wait only for the group "
                                "that computes S")
        elif kind == "wait":
            wg.waited[a["buffer"]] = event.line
        elif kind == "release":
            buf = a["buffer"]
            if buf not in wg.waited:
                fail(wg, event, f"{buf.pipe} buffer {buf.index} is released without a consumer_wait before it "
                                "(or twice): the producer would overwrite a buffer someone still reads")
            for g in wg.groups:
                if any(r == buf for r in g.reads if isinstance(r, Buffer)):
                    fail(wg, event, f"{buf.pipe} buffer {buf.index} is released while the WGMMA issued at line "
                                    f"{g.line} may still read it: the TMA may overwrite it mid-GEMM. Release "
                                    "after the wait_group that covers that GEMM")
            del wg.waited[buf]
        wg.at += 1
        return True

    while True:
        progressed = False
        for name in priority:
            wg = wgs[name]
            while not wg.done and step(wg):
                progressed = True
        if all(w.done and w.blocked_on is None for w in wgs.values()):
            break
        if not progressed:
            # Nothing ran: every unfinished warpgroup sits in the bar.sync it last stepped over.
            lines = [f"{w.name} waits on {barrier(w.blocked_on)} at {_where(path, w.events[w.at - 1].line)}"
                     for w in wgs.values() if w.blocked_on is not None]
            raise SyncError("deadlock (on a GPU, a hang): " + "; ".join(lines) + ". Nobody left will arrive on "
                            "those barriers: check that each warpgroup passes the turn to the NEXT one, and that "
                            "the first turn is given once")
    for w in wgs.values():
        if w.waited:
            buf, line = next(iter(w.waited.items()))
            raise SyncError(f"{w.name}, {_where(path, line)}: {buf.pipe} buffer {buf.index} is waited for and never "
                            "released: the producer will wait for it forever")
        if w.groups:
            raise SyncError(f"{w.name}, {_where(path, w.groups[0].line)}: a WGMMA group is still in flight when the "
                            "warpgroup finishes")


def check_stage8(module, *, overlapped: bool = True, num_wgs: int = 2):
    """Stage 8's MMA warpgroups, recorded and replayed, in both orders of who runs first."""
    path = inspect.getsourcefile(module)
    programs = {f"MMA warpgroup {wg}": record_stage8(module, wg, overlapped=overlapped, num_wgs=num_wgs)
                for wg in range(num_wgs)}
    scheduler = {int(module.NamedBarrier.SCHEDULER_WG1) + wg for wg in range(num_wgs)}
    names = list(programs)
    barrier_names = {int(module.NamedBarrier.SCHEDULER_WG1) + wg: f"MMA warpgroup {wg}'s scheduler barrier"
                     for wg in range(num_wgs)}
    for priority in (names, names[::-1]):
        replay(programs, path, scheduler_barriers=scheduler, priority=priority, barrier_names=barrier_names)


# ---------------------------------------------------------------- stage 10: the producer's loads per work tile

class _Anything:
    """Whatever the producer computes that its loads do not depend on (layouts, views, TMA partitions)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *_, **__):
        return self

    def __getitem__(self, _):
        return self

    def __floordiv__(self, _):
        return self

    __rfloordiv__ = __mul__ = __rmul__ = __add__ = __radd__ = __floordiv__


class _ProducerPipeline:
    def __init__(self, log: list, name: str, line):
        self.log, self.name, self.line = log, name, line

    def producer_acquire(self, state: State):
        self.log.append(("acquire", self.name, state.count, self.line()))

    def producer_get_barrier(self, state: State):
        return ("full barrier", self.name, state.index)

    def producer_tail(self, state: State):
        self.log.append(("tail", self.name, state.count, self.line()))


def check_varlen_producer(module, *, page_rows: int, gather: bool, warp: int = 0,
                          work: tuple = ((2, 3), (9, 0), (0, 1), (1, 0), (1, 4))) -> None:
    """Stage 10's producer (``VarlenAttention.load``) as plain Python for a list of work tiles ``(batch, KV
    tiles)`` (batch 9: past the last sequence, nothing to load), with stand-ins for everything but its loop:
    each tile's Q once (by warp 0), then K of its KV tiles 0, 1, .. and V one behind (K0 Q K1 V0 K2 V1 ..
    V(n-1)), every K and V buffer state used once in turn, and the pipelines' tails at the end. A K or V load
    missing, doubled or out of that order leaves the MMA warps waiting on a buffer that never fills: the kernel
    hangs on the GPU."""
    from types import SimpleNamespace

    log: list = []
    path = inspect.getsourcefile(module)
    rec = Recorder(path)

    def load_kv_tile(pipe, state, *args):
        log.append(("load", pipe.name, args[3], state.count, rec.line(), args[5]))

    def make_pipeline_state(_kind, stages):
        return State(stages)

    class Mask:
        def __init__(self, m_block, *_):
            self.n = tiles[m_block][1]  # (the stand-in scheduler's m_block is the work tile's index)

        def kv_block_range(self):
            return 0, self.n

        def sink_block_count(self, _lo):
            return 0

        def kv_block(self, i, _lo, _hi):
            return ("KV tile", int(i))

    tiles = list(work)
    scheduler = SimpleNamespace(
        tile_range=lambda: (0, len(tiles), 1), num_batch=len(tiles),
        locate=lambda tile, _batch, _start: (tiles[tile][0] if tiles[tile][0] != 9 else len(tiles), 0),
        coords=lambda rank, _sq, _sk: (rank, 0))
    anything = _Anything()
    arch = SimpleNamespace(make_warp_uniform=lambda x: x, warp_idx=lambda: warp)
    cute = SimpleNamespace(arch=arch, make_layout=anything, make_tensor=anything, select=anything,
                           group_modes=anything, flat_divide=anything, local_tile=anything,
                           domain_offset=anything, copy=anything)
    cutlass = SimpleNamespace(range=_range, range_constexpr=_range, const_expr=lambda x: x, Int32=int,
                              Constexpr=object)
    pipeline = SimpleNamespace(make_pipeline_state=make_pipeline_state, PipelineUserType=anything)
    cpasync = SimpleNamespace(tma_partition=lambda *_: (anything, anything))
    scope = as_python(module, ("VarlenAttention.load",), dict(
        cute=cute, cutlass=cutlass, pipeline=pipeline, cpasync=cpasync, load_kv_tile=load_kv_tile, WindowMask=Mask,
        sequence_rows=lambda *_: (0, 100), sequence_keys=lambda *_: (0, 1000),
        tile_pages=lambda n_block, *_: ("pages of", n_block)))
    config = SimpleNamespace(has_seqused_k=False)
    this = SimpleNamespace(head_dim=128, head_dim_v=128, tile_n=128, tile_m=128, page_rows=page_rows, gather=gather,
                           config=config, key_capacity=lambda *_: 1000, smem_layouts=lambda: (anything,) * 4)
    mQ = _Anything()
    mQ.__dict__["shape"] = (100, 128, 8)
    pipes = [_ProducerPipeline(log, name, rec.line) for name in "QKV"]
    scope["load"](this, scheduler, anything, mQ, anything, anything, anything, anything, anything, anything,
                  anything, (anything,) * 4, *pipes, (0, 0, 0))
    setup = f"(page_rows {page_rows}, gather {gather}, producer warp {warp}, work tiles (batch, KV tiles) {work})"
    loads_q = warp == 0
    expected, counts = [], {"Q": 0, "K": 0, "V": 0}

    def expect(pipe, block):
        if pipe != "Q" or loads_q:
            expected.append((pipe, block, counts[pipe]))
            counts[pipe] += 1

    for batch, n in tiles:
        if batch == 9:
            continue
        if n > 0:
            expect("K", ("KV tile", 0))
        expect("Q", None)
        for i in range(1, n):
            expect("K", ("KV tile", i))
            expect("V", ("KV tile", i - 1))
        if n > 0:
            expect("V", ("KV tile", n - 1))
    loads = [event for event in log if event[0] == "acquire" and event[1] == "Q" or event[0] == "load"]
    got = [("Q", None, event[2]) if event[0] == "acquire" else event[1:4] for event in loads]
    if got != expected:
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        line = loads[min(first, len(loads) - 1)][-1] if loads else 0
        if not loads_q and first < len(got) and got[first][0] == "Q":
            raise SyncError(f"{_where(path, line)}: {setup}: producer warp {warp} loads Q; only warp 0 may: Q's "
                            "full barrier expects one arrival per tile, and a second copy would overwrite the tile")
        raise SyncError(f"{_where(path, line)}: {setup}: load {first} is "
                        f"{got[first] if first < len(got) else 'missing'}, expected "
                        f"{expected[first] if first < len(expected) else 'none'} ((pipeline, KV tile, buffer "
                        "state count)); per work tile the producer loads K of its first KV tile, then Q, then K of "
                        "tile i and V of tile i - 1 for i = 1 .. n - 1, then V of the last, each with its "
                        "pipeline's next state: a missing load leaves the MMA warps waiting forever")
    for event in (event for event in log if event[0] == "load" and event[5] != ("pages of", event[2])):
        raise SyncError(f"{_where(path, event[4])}: {setup}: {event[1]} of {event[2]} is loaded with the pages of "
                        f"{event[5][1] if isinstance(event[5], tuple) else event[5]}; a tile's K and V live in its "
                        "own pages (V one step behind K takes the pages K's copies looked up one step before)")
    tails = [event[1:3] for event in log if event[0] == "tail"]
    want = [(name, counts[name]) for name in ("QKV" if loads_q else "KV")]
    if tails != want:
        line = next((event[-1] for event in log if event[0] == "tail"), 0)
        raise SyncError(f"{_where(path, line)}: {setup}: the producer's tails are {tails}; expected {want} (pipeline, state count): "
                        "producer_tail waits until the consumers released every buffer, after the last load")
