#!/usr/bin/env bash
# A new user's first hour, scripted: image folders in every layout image_folder reads (and three it
# refuses), then the README's commands on each, as written, with each command's wall time, exit code
# and what it printed. Usage: benchmarks/tools/first_hour.sh [OUT_DIR] (default bench/first_hour).
# Needs the project installed (`pip install -e .`) and Pillow (a torchvision dependency).
set -uo pipefail
OUT=${1:-bench/first_hour}
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
TS=${TORCHSPRINT:-torchsprint}

# Photos of several sizes (as a phone or a scrape gives them), 3 classes, learnable shapes on noise.
$PY - "$OUT/data" <<'PYEOF'
import random, sys
from pathlib import Path
from PIL import Image, ImageDraw
root = Path(sys.argv[1]); rng = random.Random(0)
def photo(path, c):
    w, h = rng.choice([(160, 120), (120, 160), (200, 150), (96, 96)])
    im = Image.effect_noise((w, h), 40).convert("RGB")
    d = ImageDraw.Draw(im); box = [w // 5, h // 5, 4 * w // 5, 4 * h // 5]
    [d.ellipse, d.rectangle, lambda b, fill: d.polygon([(b[0], b[3]), ((b[0] + b[2]) // 2, b[1]), (b[2], b[3])], fill=fill)][c](box, fill=(230, 60 * c, 40))
    path.parent.mkdir(parents=True, exist_ok=True); im.save(path, quality=88)
classes = ["cat", "dog", "fox"]
def tree(base, splits, n):
    for s in splits:
        for ci, c in enumerate(classes):
            for i in range(n):
                photo(base / s / c / f"{s or 'img'}_{i:03d}.jpg", ci)
tree(root / "train_val", ["train", "val"], 30)
tree(root / "train_valid", ["train", "valid"], 30)
tree(root / "train_validation_test", ["train", "validation", "test"], 30)
tree(root / "train_only", ["train"], 40)
tree(root / "one_folder", [""], 40)
tree(root / "mistake_mixed", ["train", "val", "extra_class"], 3)
tree(root / "mistake_two_vals", ["train", "val", "valid"], 3)
tree(root / "mistake_wrapped" / "my_dataset", ["train", "val"], 3)
PYEOF

SPEC='data.train.transforms=[random_resized_crop: 64, hflip, normalize: imagenet]'
EVAL='data.eval.transforms=[resize: 72, center_crop: 64, normalize: imagenet]'
RESULTS="$OUT/results.md"
N=0
echo "| layout | command | exit | wall s | first lines printed |" > "$RESULTS"
echo "|---|---|---|---|---|" >> "$RESULTS"

run() {  # run LAYOUT CMD...: time it, keep its output, add a row
  local layout=$1; shift
  N=$((N + 1))
  local log="$OUT/logs/$(printf %02d $N)_${layout}_$2.txt"
  mkdir -p "$OUT/logs"
  local t0=$(date +%s.%N)
  "$@" > "$log" 2>&1
  local rc=$?
  local t1=$(date +%s.%N)
  local secs=$($PY -c "print($t1 - $t0)")
  local said=$(grep -v '^\s*$' "$log" | grep -E 'data:|splits:|loader:|error|holds|test split|classes|unreadable|top1' | head -4 | tr '\n|' ' /' | cut -c1-400)
  printf "| %s | \`%s\` | %s | %.1f | %s |\n" "$layout" "$(echo "${@:2:3}" | cut -c1-60)" "$rc" "$secs" "$said" >> "$RESULTS"
  echo "$layout: ${*:1:2} -> exit $rc in ${secs}s"
}

for layout in train_val train_valid train_validation_test train_only one_folder; do
  D="$OUT/data/$layout"
  run "$layout" $TS data check data.dataset=image_folder data.root="$D" "$SPEC" "$EVAL" --out "$OUT/check_$layout"
  EXTRA=()
  [ "$layout" = train_validation_test ] && EXTRA=(eval.test_at_end=true)
  run "$layout" $TS train data.dataset=image_folder data.root="$D" "$SPEC" "$EVAL" model.name=small_cnn run.epochs=3 \
      data.batch_size=32 log.progress=false run.dir="$OUT/runs/$layout" "${EXTRA[@]}"
  [ "$layout" = train_validation_test ] && run "$layout" $TS eval -r "$OUT/runs/$layout" --split test
  run "$layout" $TS report "$OUT/runs/$layout"
done
for layout in mistake_mixed mistake_two_vals mistake_wrapped; do
  run "$layout" $TS train data.dataset=image_folder data.root="$OUT/data/$layout" run.dir="$OUT/runs/$layout"
done
echo; cat "$RESULTS"
