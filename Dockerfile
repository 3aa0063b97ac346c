# syntax=docker/dockerfile:1
# outbox-relay container image: the binary built in a Rust image, run from a
# distroless-like stage that holds only the binary, the shared libraries it links (as ldd
# lists them: glibc, OpenSSL, zlib, libgcc_s), CA certificates and a passwd entry for its
# user. No shell, no package manager.
#
#   docker build -t outbox-relay .
#   docker run --rm -v $PWD/relay.toml:/etc/outbox-relay/relay.toml:ro outbox-relay
#
# Where no registry is reachable, scripts/image builds this same file with podman: the
# binary built on the host (BINARY=prebuilt) and a Debian base made with debootstrap
# (BASE_IMAGE=localhost/debian:bookworm). Only the source of the binary and of the Debian
# files differs; the runtime stage is this one.
#
# The relay drains on SIGTERM within shutdown.drain_timeout (25s by default): give the
# container a stop timeout above it (docker stop -t 40; Kubernetes
# terminationGracePeriodSeconds, see examples/kubernetes-sidecar.yaml).

# The Rust toolchain image the `build` stage compiles in.
ARG RUST_IMAGE=rust:1-bookworm
# The Debian the runtime's files come from: the release RUST_IMAGE is built on, so that
# the binary finds the glibc it was linked against.
ARG BASE_IMAGE=debian:bookworm-slim
# Where the binary comes from: `build` (compiled in RUST_IMAGE), or `prebuilt`
# (target/image/outbox-relay, put there stripped by scripts/image).
ARG BINARY=build

FROM ${RUST_IMAGE} AS build
# libcurl4-openssl-dev: the bundled librdkafka includes curl/curl.h even with curl off.
# Debian's security updates replace package versions: pinning them breaks rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake libcurl4-openssl-dev libssl-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The release profile keeps line tables (94 MB with librdkafka's); the image gets the
# binary without debug info (symbols stay, for panic backtraces), and the debug info is
# kept beside it in this stage: docker build --target build, /out/outbox-relay.debug.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outbox-relay \
 && install -D -m 0755 target/release/outbox-relay /out/outbox-relay \
 && objcopy --only-keep-debug /out/outbox-relay /out/outbox-relay.debug \
 && strip --strip-debug /out/outbox-relay \
 && objcopy --add-gnu-debuglink=/out/outbox-relay.debug /out/outbox-relay

# A binary built outside (scripts/image strips it the same way, debug info beside it in
# target/image/); .dockerignore lets this one file of target/ into the build context.
FROM scratch AS prebuilt
COPY target/image/outbox-relay /out/outbox-relay

FROM ${BINARY} AS binary

# The runtime's file system, gathered under /rootfs in a Debian of the binary's release.
FROM ${BASE_IMAGE} AS rootfs
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/*
COPY --from=binary /out/outbox-relay /rootfs/usr/local/bin/outbox-relay
COPY config/relay.example.toml /rootfs/etc/outbox-relay/relay.example.toml
# Every shared library the binary loads, at the path ldd resolves it to (a library that is
# not found fails the build, not the container's start); the CA bundle where OpenSSL
# (through /usr/lib/ssl), librdkafka and rustls look for it; passwd and group entries for
# the numeric user, as distroless images have them.
RUN ldd /rootfs/usr/local/bin/outbox-relay > /tmp/ldd \
 && cat /tmp/ldd \
 && if grep -q 'not found' /tmp/ldd; then exit 1; fi \
 && awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' /tmp/ldd > /tmp/libs \
 && xargs -a /tmp/libs -I{} cp -L --parents {} /rootfs \
 && cp -a --parents /etc/ssl/certs /etc/ssl/openssl.cnf /usr/share/ca-certificates \
      /usr/lib/ssl/cert.pem /usr/lib/ssl/certs /usr/lib/ssl/openssl.cnf /rootfs \
 && printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
      > /rootfs/etc/passwd \
 && printf 'root:x:0:\nnonroot:x:65532:\n' > /rootfs/etc/group \
 && printf 'hosts: files dns\n' > /rootfs/etc/nsswitch.conf \
 && install -d -m 1777 /rootfs/tmp \
 && install -d -m 0700 -o 65532 -g 65532 /rootfs/home/nonroot

FROM scratch
COPY --from=rootfs /rootfs/ /
# A numeric non-root user: Kubernetes runAsNonRoot can verify it without a passwd entry.
USER 65532:65532
ENV PATH=/usr/local/bin:/usr/bin:/bin RUST_LOG=info
STOPSIGNAL SIGTERM
ENTRYPOINT ["outbox-relay"]
CMD ["run", "--log-format", "json"]
