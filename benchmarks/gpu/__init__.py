"""The GPU job: the measurements of one device window (measure.py), merging its calls' results (merge_results.py); the
shell scripts around them (window.sh, run_all.sh, fetch_wheels.sh)."""
