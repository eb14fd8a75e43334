#!/usr/bin/env bash
# Build the Dockerfile as committed into a CPU image and run the project in it, on a Linux machine without a
# Docker daemon or GPUs (root, Debian's packages reachable): buildah builds and runs the image.
#
#   bash launch/docker_check.sh
#
# 1. installs buildah and debootstrap where missing;
# 2. builds a Debian bookworm base image with debootstrap, once (kept as localhost/dflash-ddp-base:bookworm);
# 3. builds the project's image from the Dockerfile with --build-arg BASE_IMAGE=<that base> and
#    TORCH_INDEX_URL= (torch from pip's own configured indexes, mounted from this machine: its pip
#    configuration, certificates and local wheel directories);
# 4. runs in the image: `python -m dflash_ddp.train --help`, the embedded default as 1 target + 1 drafter rank
#    through the image's entry point with a short budget (ending with its tau table and the lossless check),
#    and the export of its last checkpoint.
# Each step prints its time; the last line says what held. A second run reuses the base image.
set -euo pipefail
cd "$(dirname "$0")/.."

STORE=(--storage-driver vfs)
BASE=${BASE:-localhost/dflash-ddp-base:bookworm}
IMAGE=${IMAGE:-localhost/dflash-ddp:cpu}
WORK=${WORK:-/var/tmp/dflash-ddp-docker-check}
STEPS=${STEPS:-30}
declare -a TIMES=()

step() {  # step NAME COMMAND...: run, time, and remember the time
  local name=$1 start end
  shift
  echo "=== $name"
  start=$(date +%s)
  "$@"
  end=$(date +%s)
  TIMES+=("$name $((end - start)) s")
  echo "=== $name: $((end - start)) s"
}

install_tools() {
  if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q && apt-get install -y -q buildah debootstrap
  fi
}

build_base() {
  if buildah "${STORE[@]}" images --quiet "$BASE" >/dev/null 2>&1; then
    echo "reusing $BASE"
    return
  fi
  local rootfs=$WORK/rootfs
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" http://deb.debian.org/debian
  local ctr
  ctr=$(buildah "${STORE[@]}" from scratch)
  buildah "${STORE[@]}" copy "$ctr" "$rootfs" /
  buildah "${STORE[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah "${STORE[@]}" commit --rm "$ctr" "$BASE"
  rm -rf "$rootfs"
}

# pip inside the build sees this machine's pip configuration, certificates and local wheel directories.
pip_volumes() {
  local path
  for path in /etc/pip.conf /etc/xdg/pip /root/.config/pip /etc/ssl/certs /opt/wheels /opt/pypi /opt/pypi-more; do
    if [ -e "$path" ]; then
      printf -- '--volume=%s:%s:ro\n' "$path" "$path"
    fi
  done
}

build_image() {
  mapfile -t volumes < <(pip_volumes)
  buildah "${STORE[@]}" bud --isolation chroot "${volumes[@]}" \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_INDEX_URL= -t "$IMAGE" -f Dockerfile .
}

# buildah run's container gets a random hostname its /etc/hosts does not list; torchrun's rendezvous then
# times out. Docker lists it; here the container is named localhost.
in_image() {
  buildah "${STORE[@]}" run --isolation chroot --hostname localhost "$@"
}

run_help() {
  in_image "$CTR" -- python -m dflash_ddp.train --help | head -5
}

run_default() {
  # the image's entry point, as `docker run IMAGE --max_steps ...` runs it: NPROC CPU processes (1 + 1)
  in_image --env NPROC=2 --env OMP_NUM_THREADS=1 "$CTR" -- bash launch/single_node.sh \
    --max_steps "$STEPS" --save_steps 10 --eval_prompts 5 --eval_max_new_tokens 32 --output_dir runs/check \
    | tee "$WORK/default.log"
  grep -q "lossless: every output equals greedy" "$WORK/default.log"
}

run_export() {
  in_image "$CTR" -- python -m dflash_ddp.export runs/check runs/check/export
  in_image "$CTR" -- python -c "import json; c = json.load(open('runs/check/export/config.json')); \
print('exported:', c['architectures'], c['dflash_config'])"
}

mkdir -p "$WORK"
step "install buildah and debootstrap" install_tools
step "base image (Debian bookworm)" build_base
step "build the image from the Dockerfile" build_image
CTR=$(buildah "${STORE[@]}" from "$IMAGE")
trap 'buildah "${STORE[@]}" rm "$CTR" >/dev/null 2>&1 || true' EXIT
step "python -m dflash_ddp.train --help" run_help
step "embedded default, 1 target + 1 drafter rank, $STEPS steps" run_default
step "export of the last checkpoint" run_export
printf '%s\n' "${TIMES[@]}"
tau=$(grep -m1 "DFlash, this drafter" "$WORK/default.log" | tr -s ' │|' ' ' | cut -d' ' -f5)
echo "docker check: OK: the Dockerfile built on $BASE, the default job ran in it to tau $tau (lossless), the export was written"
