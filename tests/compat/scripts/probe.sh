#!/bin/sh
# --no-python worker: records what a shell script sees (torchrun's test_script.sh does the same).
mkdir -p "$PROBE_OUT"
printf '{"env": {"RANK": "%s", "LOCAL_RANK": "%s", "WORLD_SIZE": "%s", "GROUP_RANK": "%s"}, "argv": ["%s", "%s"]}' \
    "$RANK" "$LOCAL_RANK" "$WORLD_SIZE" "$GROUP_RANK" "$0" "$1" > "$PROBE_OUT/$RANK.json"
