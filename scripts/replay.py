"""What the guesses alone are worth, without timing noise: each prompt is answered once by plain decoding (eager),
then FAFO's guesses from the text with its step planner, and SuffixDecoding's draft trees, are replayed over that
answer, each step accepting what the answer confirms. A step costs what this machine's eager pass costs with its
rows (measured first, after --context cached tokens), so the speedup column is the guesses' worth against plain
decoding on that curve; the planner plans with the same curve. Also the copy ceiling: steps that verify exactly the
longest continuation of the answer that occurs anywhere earlier in the text (at most --most tokens), the most that
drafting from the text could make of the curve, knowing where to copy from and for how long. No window (nothing
runs the model during the replay). With --packages, the steps are compiled ones instead: each set of package sizes
is timed side by side (missing packages built first: minutes each), every step is padded up to the package that
holds it, and FAFO's planner chooses among that set's sizes, so sets of sizes can be compared on the same answers
(SuffixDecoding and the copy ceiling are replayed once, on the first set's). --row-ms asks what a cheaper multi-row
product would be worth: every point of the curve past 4 rows costs the 4-row one plus that much a row. With
--temperature the answers are sampled, one per seed: every method that verifies one-hot guesses emits exactly plain
sampling's tokens with the same seed (keyed draws, runtime/sampling.py), so a guess is accepted when the sampled
answer confirms it, as greedy; FAFO then offers as many copies as it does when sampling.

    python scripts/replay.py --suites chat,edit,code --samples 3
    python scripts/replay.py --dtype float32 --suites chat,math --packages 1,4,9,20 1,2,4,9,20
    python scripts/replay.py --suites chat,summarize --temperature 0.7 --seeds 3
    python scripts/replay.py --suites edit --samples 3 --row-ms 0.58
"""

from __future__ import annotations

import statistics

from fafo_cli.bench.tune import step_costs
from fafo_cli.compiled.timing import side_by_side
from fafo_cli.decoders.fafo.planner import Acceptance, Planner, StepCosts
from fafo_cli.decoders.fafo.step import AUTO_COPIES, text_chains, text_index
from fafo_cli.decoders.suffix import Suffix
from fafo_cli.decoders.suffix_index import SuffixIndex
from fafo_cli.decoders.tree import DraftTree
from fafo_cli.decoders.verify import accept_tree

import common


def replay(answer: list[int], prompt: list[int], cost: StepCosts, guess) -> tuple[int, int, float]:
    """Steps, rows and milliseconds to emit `answer` when each step verifies the tree `guess.draft(text)` returns and
    accepts what the answer confirms, as `accept_tree` does with plain decoding's tokens (`guess.accepted` is told
    each step's outcome)."""
    at, steps, rows, ms = 1, 0, 0, 0.0
    while at < len(answer):
        tree = guess.draft(prompt + answer[:at])

        def plain(row: int) -> int:  # the answer's token after the row (-1, no token, past its end)
            position = at + (tree.depths[row - 1] if row else 0)
            return answer[position] if position < len(answer) else -1

        path, emitted = accept_tree(tree, plain)
        emitted = emitted[:len(answer) - at]  # a copy that runs to the answer's end has no token after it
        guess.accepted(emitted, path)
        at, steps, rows, ms = at + len(emitted), steps + 1, rows + 1 + len(tree), ms + cost.of(1 + len(tree))
    return steps, rows, ms


class FafoGuesses:
    def __init__(self, text: list[int], cost: StepCosts, draft_tokens: int, greedy: bool = True):
        self.index, self.draft_tokens, self.copies = text_index(), draft_tokens, AUTO_COPIES[greedy]
        self.index.extend(text)
        self.planner = Planner(Acceptance(), cost, window_rows=0, max_nodes=draft_tokens)

    def draft(self, text):
        self.plan = self.planner.plan(text_chains(self.index, self.copies, self.draft_tokens), room=1 << 30)
        return self.plan.tree

    def accepted(self, emitted, path):
        self.planner.observe(self.plan, path)
        costs = self.planner.costs  # each step took what the curve says (so compiled plain steps count as measured)
        costs.observe(self.plan.rows, self.plan.window, costs.of(self.plan.rows))
        self.index.extend(emitted)


class SuffixGuesses:
    def __init__(self, text: list[int], config):
        self.drafter = Suffix(config, history=None)  # a fresh request, as the bench runs it
        self.drafter.text.extend(text)

    def draft(self, text):
        return self.drafter.draft(text, room=1 << 30).tree

    def accepted(self, emitted, path):
        self.drafter.accepted(emitted, len(emitted))  # it indexes the text's last `new` tokens


class CopyCeiling:
    """Each step's tree: the longest run of the answer from here on that occurs earlier in the text."""

    def __init__(self, prompt: list[int], answer: list[int], most: int):
        self.index, self.prompt, self.answer, self.most = SuffixIndex(), prompt, answer, most
        self.index.extend(prompt + answer[:1])

    def draft(self, text):
        at, run = len(text) - len(self.prompt), []
        while len(run) < self.most and at + len(run) < len(self.answer) and \
                self.index.find(self.answer[at:at + len(run) + 1])[1] == len(run) + 1:
            run.append(self.answer[at + len(run)])
        tree = DraftTree()
        tree.add_chain(run)
        return tree

    def accepted(self, emitted, path):
        self.index.extend(emitted)


def package_costs(engine, sets: list[list[int]], context: int) -> dict[str, StepCosts]:
    """Each set of compiled package sizes as StepCosts, all of them timed side by side in one round."""
    if any(1 not in sizes for sizes in sets):
        raise SystemExit("--packages: every set needs the one-row package (plain decoding's step)")
    compiled = engine.session.compiled
    runners = {size: compiled.runner(size) for size in sorted(set().union(*sets))}
    if None in runners.values():
        raise SystemExit("--packages: a package could not be built or loaded")
    ms = side_by_side(engine.model, runners, context=context)
    return {",".join(map(str, sizes)): StepCosts({size: ms[size] for size in sizes}, sizes) for sizes in sets}


def past_four(ms: dict[int, float], row_ms: float) -> dict[int, float]:
    """The curve `ms` with every point past 4 rows at the 4-row cost plus `row_ms` a row."""
    if 4 not in ms:
        raise SystemExit("--row-ms: the curve needs a 4-row point (a 4-row package)")
    return {rows: ms[4] + row_ms * (rows - 4) if rows > 4 else cost for rows, cost in ms.items()}


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "suites", "samples", "prompts", suites="chat,edit,code",
                           tokens=256)
    parser.add_argument("--context", type=int, default=1024, help="cached tokens when the pass costs are measured")
    parser.add_argument("--most", type=int, default=16, help="the ceiling's longest copy per step")
    parser.add_argument("--packages", nargs="+", default=None, metavar="SIZES",
                        help="replay on compiled steps: sets of package sizes, each comma-separated with 1 among them "
                             "(e.g. 1,4,9,20 1,2,4,9,20)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample the answers (0: greedy)")
    parser.add_argument("--seeds", type=int, default=1, help="sampled answers per prompt, seeds 1..N (with --temperature)")
    parser.add_argument("--row-ms", type=float, default=None,
                        help="replay on a curve whose rows past 4 cost this many ms each beyond the 4-row step")
    args = parser.parse_args()
    engine = common.load_engine(args, compile="on" if args.packages else "auto")
    costs = {"eager": StepCosts(step_costs(engine, context=args.context))} if not args.packages else \
        package_costs(engine, [sorted(map(int, sizes.split(","))) for sizes in args.packages], args.context)
    if args.row_ms is not None:
        costs = {name: StepCosts(past_four(dict(cost.points), args.row_ms), cost.sizes)
                 for name, cost in costs.items()}
    for name, cost in costs.items():  # never told a step's time: as measured, for every replay and the planner
        print(f"{name} pass, ms by rows: " + ", ".join(f"{rows} {ms:.1f}" for rows, ms in cost.points))
    config = engine.request_config(method="fafo", max_tokens=args.tokens)
    speedups: dict[tuple[str, str], list[float]] = {}
    greedy = args.temperature == 0
    answers = [(sample, seed) for sample in common.prompts(args, engine) for seed in range(1, 2 if greedy else args.seeds + 1)]
    for sample, seed in answers:
        engine.reset()
        prompt = engine.encode(list(sample.messages))
        answer = engine.complete(list(sample.messages), method="vanilla", max_tokens=args.tokens,
                                 temperature=args.temperature, seed=seed).token_ids
        guesses = [(f"fafo {sizes}" if args.packages else "fafo", cost,
                    FafoGuesses(prompt + answer[:1], cost, config.draft_tokens, greedy))
                   for sizes, cost in costs.items()]
        first = next(iter(costs.values()))
        guesses += [("suffix", first, SuffixGuesses(prompt + answer[:1], config)),
                    ("copy ceiling", first, CopyCeiling(prompt, answer, args.most))]
        for name, cost, guess in guesses:
            plain = (len(answer) - 1) * cost.of(1)
            steps, rows, ms = replay(answer, prompt, cost, guess)
            speedups.setdefault((sample.suite, name), []).append(plain / ms)
            print(f"{sample.suite:9s} {sample.id[:36] + ('' if greedy else f'#{seed}'):40s} {name:18s} τ {len(answer) / (steps + 1):.2f} "
                  f"rows {rows / steps:.2f} speedup {plain / ms:.2f}", flush=True)
    for (suite, name), values in speedups.items():
        print(f"{suite:9s} {name:18s} median speedup {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
