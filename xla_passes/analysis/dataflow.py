"""A sparse forward dataflow engine over HLO values, which the analyses of values share.

A client, a `ForwardLattice`, says what it knows about one value: its states and how two of them
combine (`join`), what each instruction makes of its operands' states (`transfer`), and where
the parameters of the computation it asks about start (`parameter`). `ForwardDataflow` does the
rest, the way MLIR's SparseForwardDataFlowAnalysis and XLA's HloDataflowAnalysis do:

* a value's state is the client's leaf state, or a Python tuple of states for a tuple-shaped
  value, element by element (a leaf state where a tuple is expected stands for every element):
  `tuple` and `get-tuple-element` are the engine's, so clients never see tuple plumbing;
* it walks each computation in post order, so that operands come before their users, and
  descends into the computations an instruction calls, with the operands' states as the callee's
  parameters: `call` (the result is the callee root's), `fusion` for clients that look into
  fusion bodies (`ForwardLattice.descends`; a body left unparsed stays unread otherwise),
  `conditional` (the join of the branches' roots), and `while`, whose loop-carried state is the
  join of the init and the body's result, iterated until it stops growing (a fixed point, since
  states only grow and a lattice has finite height); the condition sees the same state.
  `through_control` lets the result of the last two depend on the value that decides the
  control flow (devices that disagree on a predicate take different branches).

Each call site is analysed with its own operands' states, memoized by (computation, parameter
states): the precision that XLA gets by flattening the call graph first, without copying
anything. `value(instr)` of an instruction in a called computation is the join over the
contexts it was analysed in.

`BackwardDataflow` goes the other way, from a value's users back to the value, within one
computation: what a client (a `BackwardLattice`) asks there is what becomes of a value, such as
whether something computed from it is per example. HLO has no cycles, so one walk in reverse post
order, users before the values they read, gives every state.

Both engines can run sparse, on the part of a computation a client cares about, as MLIR's
analyses visit only what their states change: a forward run from `sources` transfers the sources
and, in post order, only the users of values whose state is not `ForwardLattice.unreached` (the
rest keep that state); a backward run `within` a set of values gives states to those alone. A pass that asks about each of its
hundreds of weights in a 30,000-instruction training step then pays for each weight's few
instructions, not for the step.

An analysis built on it is computed once per pass run while the module stays as it is in the
run's `PassContext.analysis`, this project's AnalysisManager: under a kind of its own, which a
pass that keeps it valid names in `HloPass.preserves` (`replication_analysis.REPLICATION`).
"""
from __future__ import annotations

import heapq

from hlo_tools import HloComputation, HloInstruction

# Instructions whose called computations the engine can follow values into.
_CALLING = frozenset({"call", "fusion", "while", "conditional"})


class ForwardLattice:
    """What a client of `ForwardDataflow` tracks. Leaf states are hashable (they key the memo of
    analysed calls) and never Python tuples (those are the engine's tuple-shaped values)."""

    # In a run from `sources`: the state of the values they do not reach, which must be what
    # `transfer` makes of operands that all have it.
    unreached = None

    def join(self, a, b):
        """The least state that holds both leaf states (monotone, for the loops' fixed point)."""
        raise NotImplementedError

    def parameter(self, param: HloInstruction):
        """The state of a parameter of the computation the analysis starts from."""
        raise NotImplementedError

    def transfer(self, instr: HloInstruction, operands: list):
        """The state of `instr`'s value given its operands' states: every opcode but those the
        engine handles (parameters of called computations, tuples, and what it descends into)."""
        raise NotImplementedError

    def descends(self, instr: HloInstruction, operands: list) -> bool:
        """Whether the engine follows the states into the computations that `instr` (a call, a
        fusion, a while or a conditional) calls; where not, `transfer` decides alone. By default
        all but fusion bodies, which hold nothing most clients need and may be left unparsed."""
        return instr.opcode != "fusion"

    def through_control(self, result, control):
        """The result of a conditional or while given the state of what decides which branch or
        how many iterations run (the predicate or branch index, the condition's root)."""
        return result


class ForwardDataflow:
    """The states of every value of `comp` and of what it calls, for one `ForwardLattice`; with
    `sources` (instructions of `comp`), a sparse run: `reached` holds the values it transferred.
    `positions` (each instruction of `comp` -> its place in a post order) spares computing one."""

    def __init__(self, lattice: ForwardLattice, comp: HloComputation, sources=None, positions=None):
        self.lattice = lattice
        self.comp = comp
        self._values: dict[HloInstruction, object] = {}
        self._roots: dict[tuple, object] = {}   # (computation, parameter states) -> root state
        parameters = tuple(lattice.parameter(p) for p in comp.parameters)
        self.reached = None
        if sources is None:
            self._run(comp, parameters)
        else:
            self._run_sparse(sources, parameters, positions)

    def _run_sparse(self, sources, parameters: tuple, positions) -> None:
        """Transfer `sources` and the users of every value whose state is not `unreached`, taking
        the instructions in post order (a heap keyed by position), so that each is transferred once,
        after every operand that gets a state."""
        if positions is None:
            positions = {instr: i for i, instr in enumerate(self.comp.post_order())}
        unreached = self.lattice.unreached
        self.reached = {}
        queue = [(positions[s], s) for s in dict.fromkeys(sources)]
        heapq.heapify(queue)
        queued = {s for _, s in queue}
        while queue:
            _, instr = heapq.heappop(queue)
            state = self._transfer(instr, [self._values.get(o, unreached) for o in instr.operands], parameters)
            self.reached[instr] = None
            self._values[instr] = state
            if state == unreached:
                continue
            for user in instr.users:
                if user not in queued:
                    queued.add(user)
                    heapq.heappush(queue, (positions[user], user))

    def value(self, instr: HloInstruction):
        """The state of `instr`'s value (joined over its contexts, in a called computation)."""
        if self.reached is not None and instr not in self._values and instr.parent is self.comp:
            return self.lattice.unreached
        return self._values[instr]

    def join(self, a, b):
        """`ForwardLattice.join` extended to tuple-shaped states, element by element."""
        if isinstance(a, tuple) or isinstance(b, tuple):
            size = len(a) if isinstance(a, tuple) else len(b)
            a_elements = a if isinstance(a, tuple) else (a,) * size
            b_elements = b if isinstance(b, tuple) else (b,) * size
            return tuple(self.join(x, y) for x, y in zip(a_elements, b_elements))
        return self.lattice.join(a, b)

    def _run(self, comp: HloComputation, parameters: tuple):
        """The state of `comp`'s root when its parameters have these states."""
        key = (comp, parameters)
        if key not in self._roots:
            local: dict[HloInstruction, object] = {}
            for instr in comp.post_order():
                local[instr] = self._transfer(instr, [local[o] for o in instr.operands], parameters)
            for instr, state in local.items():
                self._values[instr] = self.join(self._values[instr], state) if instr in self._values else state
            self._roots[key] = local[comp.root]
        return self._roots[key]

    def _transfer(self, instr: HloInstruction, operands: list, parameters: tuple):
        opcode = instr.opcode
        if opcode == "parameter":
            return parameters[instr.parameter_number]
        if opcode == "tuple":
            return tuple(operands)
        if opcode == "get-tuple-element":
            whole = operands[0]
            return whole[instr.attrs["index"]] if isinstance(whole, tuple) else whole
        if opcode in _CALLING and self.lattice.descends(instr, operands):
            if opcode == "while":
                return self._loop(instr, operands[0])
            if opcode == "conditional":
                return self._branches(instr, operands)
            return self._run(instr.attrs["to_apply" if opcode == "call" else "calls"], tuple(operands))
        return self.lattice.transfer(instr, operands)

    def _loop(self, loop: HloInstruction, init):
        """The loop-carried state: the join of `init` and of what the body makes of it, until stable."""
        body, condition = loop.attrs["body"], loop.attrs["condition"]
        state = init
        while True:
            decided = self._run(condition, (state,))
            carried = self.join(state, self._run(body, (state,)))
            grown = self.join(state, self.lattice.through_control(carried, decided))
            if grown == state:
                return state
            state = grown

    def _branches(self, conditional: HloInstruction, operands: list):
        """The join of the branches' roots, each branch given its operand."""
        branches = conditional.attrs.get("branch_computations") or (
            conditional.attrs["true_computation"], conditional.attrs["false_computation"])
        result = None
        for branch, operand in zip(branches, operands[1:]):
            root = self._run(branch, (operand,))
            result = root if result is None else self.join(result, root)
        return self.lattice.through_control(result, operands[0])


class BackwardLattice:
    """What a client of `BackwardDataflow` tracks: what a value's users make of it (hashable states)."""

    def join(self, a, b):
        """The least state that holds both states."""
        raise NotImplementedError

    def unused(self, instr: HloInstruction):
        """The state of `instr`'s value before any of its users is counted (one no user reads)."""
        raise NotImplementedError

    def transfer(self, user: HloInstruction, operand_number: int, user_state):
        """What `user`, whose own value has `user_state`, makes of its operand `operand_number`."""
        raise NotImplementedError


class BackwardDataflow:
    """The states of every value of `comp`, from its users back. Values are whole (a tuple's state is
    one leaf state) and called computations are not entered: a call, a loop or a fusion is a user
    like any other, for the client's `transfer` to read. With `within`, only the values in it get
    states: a user outside counts with `lattice.unused(user)`, which the client knows to be all
    that matters of it. `positions` (each instruction -> its place in a post order) orders them."""

    def __init__(self, lattice: BackwardLattice, comp: HloComputation, within=None, positions=None):
        self.lattice = lattice
        self.comp = comp
        self._values: dict[HloInstruction, object] = {}
        if within is None:
            order = comp.post_order()
        else:
            positions = positions or {instr: i for i, instr in enumerate(comp.post_order())}
            order = sorted(within, key=positions.__getitem__)
        for instr in reversed(order):
            state = lattice.unused(instr)
            for user in instr.users:
                user_state = self._values[user] if user in self._values else lattice.unused(user)
                for number, operand in enumerate(user.operands):
                    if operand is instr:
                        state = lattice.join(state, lattice.transfer(user, number, user_state))
            self._values[instr] = state

    def value(self, instr: HloInstruction):
        """The state of `instr`'s value."""
        return self._values[instr]

