"""BLEU of a Multi30k hypothesis file as the published papers compute it, beside sacrebleu's.

The published English->German figures (docs/results.md's table: Transformer-Tiny at 41.02
lowercased, the multimodal systems at 42-43) are corpus BLEU of ``multi-bleu.perl`` (or
fairseq's scorer) on text that was punctuation-normalized, Moses-tokenized and lowercased, as
in the task's ``*.lc.norm.tok.de`` files; the issue's goal and docs/results.md use sacrebleu on
detokenized text instead (its 13a tokenization, ``case:lc`` for the lowercased figure). This
scores one hypothesis file against one reference file both ways:

    D=../shared/data/multi30k
    python -m flaxformer_lite.cli.evaluate --workdir runs/m30k --method beam --beam_size 4 \\
        --source $D/test2016.en --reference $D/test2016.de --output runs/m30k/test2016.hyp
    python bench/multi30k_published_bleu.py --hyp runs/m30k/test2016.hyp \\
        --ref $D/test2016.de --lang de --out runs/m30k/published_bleu.json

The papers' preprocessing comes from sacremoses (the Moses scripts' Python port): punctuation
normalization (``normalize-punctuation.perl``), tokenization (``tokenizer.perl -l de``, no
escaping of ``& < > " '``: hypothesis and reference are escaped alike or not at all, so it
changes no match), then lowercasing; BLEU on the resulting tokens with no further tokenization
(sacrebleu ``tokenize="none"``: 4-gram corpus BLEU with the brevity penalty, multi-bleu.perl's
formula). Needs the bench extra (sacremoses).
"""

from __future__ import annotations

import argparse
import json

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from flaxformer_lite.cli.evaluate import bleu_report


def moses_lines(lines: list[str], lang: str, *, lowercase: bool) -> list[str]:
    """Punctuation-normalized, Moses-tokenized (and lowercased) copies of ``lines``."""
    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    out = []
    for line in lines:
        tokens = tokenizer.tokenize(normalizer.normalize(line), return_str=True, escape=False)
        out.append(tokens.lower() if lowercase else tokens)
    return out


def published_bleu(hypotheses: list[str], references: list[str], lang: str) -> dict:
    """Tokenized BLEU, lowercased and cased, as multi-bleu.perl computes it on Moses output."""
    scores = {}
    for name, lowercase in (("moses_tok_lc", True), ("moses_tok_cased", False)):
        hyp = moses_lines(hypotheses, lang, lowercase=lowercase)
        ref = moses_lines(references, lang, lowercase=lowercase)
        bleu = sacrebleu.corpus_bleu(hyp, [ref], tokenize="none", force=True)
        scores[name] = {"bleu": round(bleu.score, 2), "brevity_penalty": round(bleu.bp, 4)}
    return scores


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hyp", required=True, help="hypotheses, one per line (detokenized)")
    parser.add_argument("--ref", required=True, help="references, one per line (raw text)")
    parser.add_argument("--lang", default="de", help="target language for the Moses scripts")
    parser.add_argument("--out", default=None, help="write the scores here (JSON)")
    args = parser.parse_args()
    hypotheses, references = read_lines(args.hyp), read_lines(args.ref)
    if len(hypotheses) != len(references):
        raise SystemExit(
            f"error: --hyp has {len(hypotheses)} lines and --ref {len(references)}; "
            "they must be the same sentences in the same order"
        )
    report = bleu_report(hypotheses, [" ".join(r.split()) for r in references])
    result = {
        "hyp": args.hyp,
        "ref": args.ref,
        "sentences": len(hypotheses),
        "sacrebleu": {
            "bleu": round(report["bleu"].score, 2),
            "bleu_lowercase": round(report["bleu_lowercase"].score, 2),
            "signature": report["signature"],
            "signature_lowercase": report["signature_lowercase"],
        },
        "published_style": published_bleu(hypotheses, references, args.lang),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
