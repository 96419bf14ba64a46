#!/usr/bin/env bash
# Copy the committed (HEAD) version of every file with uncommitted changes into .gl/snap/, so a device run can
# restore them there (`cp -r .gl/snap/. .`) and measure exactly what is committed while edits are in progress.
set -e
rm -rf .gl/snap && mkdir -p .gl/snap
for f in $(git diff --name-only HEAD); do
  if git cat-file -e "HEAD:$f" 2>/dev/null; then mkdir -p ".gl/snap/$(dirname "$f")" && git show "HEAD:$f" > ".gl/snap/$f"; fi
done
find .gl/snap -type f | sed 's|^.gl/snap/||'
