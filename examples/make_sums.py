"""Write a JSONL task of small sums ("What is 7 + 12?" -> "19") for `--task.name=jsonl:PATH`: a task a
135M instruct model solves now and then (SmolLM2-135M-Instruct: 14.8% at temperature 1 on sums of two
numbers 0-19), so RL has signal. Made here, never downloaded.

    python examples/make_sums.py --max 49 --out sums.jsonl    # 2,500 questions, ~310 held out
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=49, help="the largest addend (addends run from 0)")
    ap.add_argument("--out", default="sums.jsonl")
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for a in range(args.max + 1):
            for b in range(args.max + 1):
                f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    print(f"wrote {(args.max + 1) ** 2} questions to {args.out}")


if __name__ == "__main__":
    main()
