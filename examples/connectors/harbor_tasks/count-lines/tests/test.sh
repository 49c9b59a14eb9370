#!/bin/bash
# Two rewards in /logs/verifier/reward.json: `reward` 1 when /app/count.txt holds the line
# count of /app/data.txt (3), and `data_intact` 1 while /app/data.txt is as shipped.
reward=0
intact=0
if [ "$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)" = "3" ]; then reward=1; fi
if [ "$(cat /app/data.txt 2>/dev/null)" = "$(printf 'alpha\nbravo\ncharlie')" ]; then intact=1; fi
echo "count: $reward, data intact: $intact"
echo "{\"reward\": $reward, \"data_intact\": $intact}" > /logs/verifier/reward.json
