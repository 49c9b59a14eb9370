#!/bin/bash
# Reward 1 when /app/hello.txt holds exactly "Hello, world!", else 0.
if [ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]; then
  echo "PASS: /app/hello.txt is right"
  echo 1 > /logs/verifier/reward.txt
else
  echo "FAIL: /app/hello.txt is missing or wrong"
  echo 0 > /logs/verifier/reward.txt
fi
