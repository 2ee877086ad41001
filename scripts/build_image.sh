#!/usr/bin/env bash
# Build the etc-agent image and smoke-test it.
#
#   scripts/build_image.sh [--flavour cpu|cuda] [--tag NAME] [--base IMAGE] [--ca-bundle FILE]
#                          [--wheels DIR] [--no-smoke] [--no-build]
#
# Engine: docker where a daemon answers, else podman (buildah's chroot isolation, the host's
# network: no daemon, no nested namespaces needed for the build). Base: the Dockerfile's
# python:3.11-slim-bookworm digest; where it cannot be pulled, a local stand-in is made once
# (debootstrap --variant=minbase bookworm with Debian's python3 and venv, imported as
# localhost/etc-agent-base:bookworm). torch's CPU wheel: from the Dockerfile's CPU index, or, where
# that is out of reach, from a local directory of wheels (--wheels, default $PIP_FIND_LINKS),
# served to the build over 127.0.0.1. A CA bundle for networks that re-sign TLS (--ca-bundle,
# default $PIP_CERT) goes to the build as the secret ca_bundle.
#
# The smoke test (the cpu flavour): etcrun --help; the example GPT trained for 20 steps by two
# workers; the user is 10001, not root; then two containers as two nodes of one job (host network,
# the embedded store): SIGTERM to the second one's PID 1 (tini) must be a planned departure (its
# etcrun exits 0 saying the job goes on) and the first must finish the job alone with exit 0.
# Prints the image size, the build time and each check; exits 1 when a build step or a check
# fails, 3 when this machine cannot build or run images at all (no engine, no base, no wheels). --no-build
# smoke-tests the image already tagged.
# docs/deployment.md#the-image.
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=cpu
tag=""
base=""
ca_bundle="${PIP_CERT:-}"
wheels="${PIP_FIND_LINKS:-}"
smoke=1
do_build=1
while [ $# -gt 0 ]; do
    case "$1" in
        --flavour) flavour="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --base) base="$2"; shift 2 ;;
        --ca-bundle) ca_bundle="$2"; shift 2 ;;
        --wheels) wheels="$2"; shift 2 ;;
        --no-smoke) smoke=0; shift ;;
        --no-build) do_build=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$flavour" in cpu|cuda) ;; *) echo "--flavour must be cpu or cuda, not $flavour" >&2; exit 2 ;; esac
tag="${tag:-etc-agent:$flavour}"
say() { printf '[build_image] %s\n' "$*"; }
check() { say "ok: $*"; }
fail() { say "FAILED: $*"; exit 1; }

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=(docker)
    build=(docker build)
    export DOCKER_BUILDKIT=1
elif command -v podman >/dev/null 2>&1; then
    # vfs: works inside a container or a sandbox, where overlay mounts are refused.
    engine=(podman --storage-driver "${ETC_PODMAN_STORAGE_DRIVER:-vfs}")
    build=("${engine[@]}" build --isolation chroot --network host --layers)
else
    echo "build_image.sh: neither a docker daemon nor podman is here (apt-get install podman buildah runc debootstrap)" >&2
    exit 3
fi
say "engine: ${engine[*]}"

build_s="-"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
    "${engine[@]}" rm -f etc-smoke-a etc-smoke-b >/dev/null 2>&1 || true
}
trap cleanup EXIT
if [ "$do_build" = 1 ]; then
dockerfile_base=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
standin=localhost/etc-agent-base:bookworm
if [ -z "$base" ]; then
    if "${engine[@]}" image exists "$dockerfile_base" 2>/dev/null \
        || timeout 120 "${engine[@]}" pull -q "$dockerfile_base" >/dev/null 2>&1; then
        base="$dockerfile_base"
    else
        base="$standin"
        if ! "${engine[@]}" image inspect "$standin" >/dev/null 2>&1; then
            say "$dockerfile_base cannot be pulled here: making the stand-in $standin (debootstrap)"
            command -v debootstrap >/dev/null || { echo "debootstrap is needed for the stand-in base" >&2; exit 3; }
            rootfs=$(mktemp -d -t etc-base-XXXXXX)
            started=$(date +%s)
            debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
                bookworm "$rootfs" http://deb.debian.org/debian >/dev/null \
                || { echo "debootstrap could not make the stand-in base (is deb.debian.org reachable?)" >&2; exit 3; }
            rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
            chmod 755 "$rootfs"  # mktemp's 0700 would become the image's / and lock every other user out
            tar -C "$rootfs" -c . | "${engine[@]}" import \
                --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
                --change 'CMD ["python3"]' - "$standin" >/dev/null
            rm -rf "$rootfs"
            say "stand-in base made in $(( $(date +%s) - started )) s"
        fi
    fi
fi
say "base: $base"
# Whether this machine can build at all (isolation, storage), apart from what the Dockerfile does.
probe_dir=$(mktemp -d -t etc-probe-XXXXXX)
printf 'FROM %s\nRUN true\n' "$base" > "$probe_dir/Dockerfile"
if ! probe_out=$("${build[@]}" -t localhost/etc-agent-probe:latest "$probe_dir" 2>&1); then
    rm -rf "$probe_dir"
    say "this machine cannot build images: $(tail -1 <<<"$probe_out")"
    exit 3
fi
rm -rf "$probe_dir"
"${engine[@]}" rmi -f localhost/etc-agent-probe:latest >/dev/null 2>&1 || true

build_args=(--build-arg "FLAVOUR=$flavour" --build-arg "BASE_IMAGE=$base"
            --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)")
if [ -n "$ca_bundle" ]; then
    [ -s "$ca_bundle" ] || { echo "--ca-bundle $ca_bundle: no such file" >&2; exit 2; }
    build_args+=(--secret "id=ca_bundle,src=$ca_bundle")
fi
cpu_index=$(sed -n 's/^ARG TORCH_CPU_INDEX=//p' Dockerfile)
if [ "$flavour" = cpu ] && ! curl -sf --max-time 15 -o /dev/null "$cpu_index/torch/"; then
    first_dir="${wheels%% *}"
    if [ -z "$first_dir" ] || ! ls "$first_dir"/torch-*+cpu-*.whl >/dev/null 2>&1; then
        echo "$cpu_index is out of reach and no directory of torch CPU wheels was given (--wheels DIR)" >&2
        exit 3
    fi
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server "$port" --bind 127.0.0.1 --directory "$first_dir" >/dev/null 2>&1 &
    server_pid=$!
    sleep 1
    say "$cpu_index is out of reach: torch's CPU wheel from $first_dir (served on 127.0.0.1:$port)"
    build_args+=(--build-arg "TORCH_CPU_INDEX=" --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
fi

started=$(date +%s)
"${build[@]}" "${build_args[@]}" -t "$tag" .
build_s=$(( $(date +%s) - started ))
fi
size_bytes=$("${engine[@]}" image inspect "$tag" --format '{{.Size}}')
size_text=$(python3 -c "print(f'{$size_bytes / 1e9:.2f} GB')")
say "$tag: built in $build_s s; image size $size_text ($size_bytes bytes)"
# The cpu image's size bound (issue: under 1.5 GB); the cuda one carries the CUDA libraries.
max_bytes=${ETC_IMAGE_MAX_BYTES:-1500000000}
if [ "$flavour" = cpu ] && [ "$size_bytes" -gt "$max_bytes" ]; then
    fail "the cpu image is $size_text, over the bound of $max_bytes bytes"
fi
if [ "$smoke" = 0 ] || [ "$flavour" != cpu ]; then
    say "smoke test skipped (${flavour} flavour or --no-smoke)"
    exit 0
fi

# How this machine runs containers: plainly, or (a sandbox with hybrid cgroups that refuses crun's
# rlimits) with runc and limits at or under this process's own.
run_opts=()
if ! timeout 300 "${engine[@]}" run --rm --network host --entrypoint true "$tag" >/dev/null 2>&1; then
    run_opts=(--runtime runc --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=32768:32768)
    timeout 300 "${engine[@]}" run --rm --network host "${run_opts[@]}" --entrypoint true "$tag" >/dev/null \
        || { say "no way to run a container here (neither crun nor runc with this machine's limits)"; exit 3; }
    say "containers run with ${run_opts[*]}"
fi
run=("${engine[@]}" run --rm --network host "${run_opts[@]}")

# One container for the quick checks (each start copies the image's files with the vfs driver).
quick=$(timeout 300 "${run[@]}" --entrypoint sh "$tag" -c 'etcrun --help; echo "--- etc-agent"; etc-agent --help; echo "--- uid $(id -u)"') \
    || fail "etcrun --help / etc-agent --help"
grep -q -- "--nproc-per-node" <<<"$quick" && check "etcrun --help" || fail "etcrun --help"
grep -q -- "sidecar" <<<"${quick#*--- etc-agent}" && check "etc-agent --help" || fail "etc-agent --help"
grep -q -- "--- uid 10001" <<<"$quick" && check "runs as UID 10001" || fail "does not run as UID 10001"

started=$(date +%s.%N)
timeout 300 "${run[@]}" "$tag" --standalone --nproc-per-node 2 -m etc_agent.examples.gpt --steps 20 > /tmp/etc-smoke-train.log 2>&1 \
    || { tail -20 /tmp/etc-smoke-train.log; fail "the example GPT, 20 steps"; }
check "the example GPT trained 20 steps on 2 workers and exited 0 in $(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Separate containers share no /tmp, where a loopback store's host leaves its secret: the job's
# secret is given to both (docs/security.md).
secret=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
node() {  # NAME IS_HOST: one node of a two-node job over the embedded store on the host's loopback
    "${engine[@]}" create --name "$1" --network host "${run_opts[@]}" -e ETC_AGENT_SECRET="$secret" \
        "$tag" --nnodes 1:2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id smoke --rdzv-conf "is_host=$2" \
        --reconfig-delay 0.5 --local-addr 127.0.0.1 --log-format json \
        -m etc_agent.examples.gpt --steps 600 --step-delay 0.05 >/dev/null
}
node etc-smoke-a 1
node etc-smoke-b 0  # both made first: a container's creation is slow, its start is not
"${engine[@]}" start etc-smoke-a >/dev/null
sleep 2
pid1=$("${engine[@]}" exec etc-smoke-a cat /proc/1/cmdline | tr '\0' ' ')
[[ "$pid1" == "tini -- etcrun "* ]] && check "PID 1 is tini, etcrun its child" || fail "PID 1 is $pid1"
"${engine[@]}" start etc-smoke-b >/dev/null
deadline=$(( $(date +%s) + 180 ))
until grep -q '"event": "workers_continue".*"world_size": 2' <<<"$("${engine[@]}" logs etc-smoke-a 2>&1)"; do
    [ "$(date +%s)" -lt "$deadline" ] || { "${engine[@]}" logs etc-smoke-a 2>&1 | tail -20; fail "two nodes never trained together"; }
    sleep 1
done
sleep 3
"${engine[@]}" kill --signal TERM etc-smoke-b >/dev/null
# Bounded: a departure that hangs fails the smoke test instead of holding it (and CI) forever.
departed=$(timeout 180 "${engine[@]}" wait etc-smoke-b) || fail "node b did not exit within 180 s of its SIGTERM"
finished=$(timeout 300 "${engine[@]}" wait etc-smoke-a) || fail "node a did not finish within 300 s"
b_log=$("${engine[@]}" logs etc-smoke-b 2>&1)
a_log=$("${engine[@]}" logs etc-smoke-a 2>&1)
[ "$departed" = 0 ] && grep -q "goes on with 1 node" <<<"$b_log" \
    && check "SIGTERM to PID 1 of node b: a planned departure, exit 0 ($(grep -o 'generation [0-9]* goes on with 1 node(s)' <<<"$b_log" | tail -1))" \
    || { tail -20 <<<"$b_log"; fail "SIGTERM to node b: exit $departed"; }
[ "$finished" = 0 ] && check "node a finished the job alone, exit 0" \
    || { tail -20 <<<"$a_log"; fail "node a exit $finished"; }
say "smoke test passed: $tag, $size_text, built in $build_s s"
