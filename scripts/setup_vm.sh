#!/usr/bin/env bash
# Install what the "vm" sandbox tier (k3/env/vm/) needs, from Debian's package registry only, and build
# its guest artefacts. Idempotent: every step is skipped when its result is already there.
#
#   host packages : qemu-system-x86 (QEMU 7.2, TCG), qemu-utils (qemu-img), busybox-static, e2fsprogs, cpio, lz4
#   cache dir     : $K3_VM_DIR (default ~/.cache/k3/vm)
#     vmlinuz           the Debian cloud kernel (linux-image-cloud-amd64), extracted, not installed into /boot
#     vmlinux           the same kernel uncompressed (an ELF QEMU boots through PVH: ~1 s faster under TCG)
#     initramfs.cpio.gz BusyBox + virtio modules + k3/env/guest/init (mounts the disk, switch_root)
#     base.qcow2        the default sandbox root disk (a symlink to base-<stamp>.qcow2: older bases stay, as
#                       snapshots' qcow2 backing chains name them): ext4 with BusyBox + k3/env/guest/{rc,agent}
#     version           a stamp of the guest sources the artefacts were built from
#
# Run as root on Debian 12 (CI's setup runs it). Prints what it did.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GUEST=$ROOT/k3/env/guest
DIR=${K3_VM_DIR:-$HOME/.cache/k3/vm}
DISK_MB=${K3_VM_DISK_MB:-4096}   # virtual size of the root disk (sparse; qcow2 stores only what is written)
mkdir -p "$DIR"
t0=$(date +%s)
say() { echo "setup_vm: $*"; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

# 1. host packages ---------------------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v qemu-img >/dev/null || need+=(qemu-utils)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed" || need+=(busybox-static)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v cpio >/dev/null || need+=(cpio)
command -v lz4 >/dev/null || need+=(lz4)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
else
  say "host packages present (qemu-system-x86_64, qemu-img, busybox-static, mkfs.ext4, cpio, lz4)"
fi
BB=/bin/busybox

# 2. kernel ----------------------------------------------------------------------------------------------
KDIR=$DIR/kernel
if [ ! -s "$DIR/vmlinuz" ] || [ ! -d "$KDIR/modules" ]; then
  resolve() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)$/\1/p' | head -1; }
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  chmod 777 "$tmp"  # apt-get download drops privileges to _apt
  pkg=$(resolve)
  if [ -z "$pkg" ] || ! (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1); then
    $SUDO apt-get update -q  # an old package list may name a version the mirror no longer has
    pkg=$(resolve)
    [ -n "$pkg" ] || { echo "setup_vm: cannot resolve linux-image-cloud-amd64" >&2; exit 1; }
    (cd "$tmp" && apt-get download -q "$pkg" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
  fi
  ls "$tmp"/*.deb >/dev/null 2>&1 || { echo "setup_vm: could not download $pkg" >&2; exit 1; }
  deb=$(ls "$tmp"/*.deb | head -1)
  say "downloaded $(basename "$deb") ($(du -h "$deb" | cut -f1)); extracting into $KDIR (not installed)"
  dpkg -x "$deb" "$tmp/x"
  rm -rf "$KDIR"; mkdir -p "$KDIR/modules"
  kver=$(ls "$tmp/x/lib/modules" | head -1)
  for m in virtio virtio_ring virtio_mmio virtio_blk virtio_console failover net_failover virtio_net; do
    f=$(find "$tmp/x/lib/modules/$kver" -name "$m.ko*" | head -1)
    [ -n "$f" ] || { echo "setup_vm: module $m missing from $pkg" >&2; exit 1; }
    case $f in
      *.ko.xz) xz -dc "$f" > "$KDIR/modules/$m.ko" ;;
      *.ko.zst) zstd -dcq "$f" > "$KDIR/modules/$m.ko" ;;
      *) cp "$f" "$KDIR/modules/$m.ko" ;;
    esac
  done
  echo "$kver" > "$KDIR/version"
  cp "$tmp/x/boot/vmlinuz-$kver" "$DIR/vmlinuz.tmp" && mv "$DIR/vmlinuz.tmp" "$DIR/vmlinuz"
  rm -rf "$tmp"; trap - EXIT
  say "kernel $kver -> $DIR/vmlinuz"
else
  say "kernel present ($(cat "$KDIR/version" 2>/dev/null))"
fi

# 2b. the uncompressed kernel (the cloud kernel is LZ4-compressed: the payload starts at the LZ4 magic)
if [ ! -s "$DIR/vmlinux" ] || [ "$DIR/vmlinux" -ot "$DIR/vmlinuz" ]; then
  off=$(LC_ALL=C grep -obUaP '\x02\x21\x4c\x18' "$DIR/vmlinuz" | head -1 | cut -d: -f1 || true)
  ok=0
  if [ -n "$off" ]; then
    tail -c +$((off + 1)) "$DIR/vmlinuz" | lz4 -dc > "$DIR/vmlinux.tmp" 2>/dev/null || true
    if [ "$(head -c 4 "$DIR/vmlinux.tmp" | od -An -tx1 | tr -d ' \n')" = "7f454c46" ]; then ok=1; fi
  fi
  if [ $ok = 1 ]; then
    mv "$DIR/vmlinux.tmp" "$DIR/vmlinux"
    say "uncompressed kernel -> $DIR/vmlinux ($(du -h "$DIR/vmlinux" | cut -f1))"
  else
    rm -f "$DIR/vmlinux.tmp"
    say "could not extract vmlinux (not LZ4?); the VMs boot vmlinuz"
  fi
else
  say "uncompressed kernel present"
fi

# 3. initramfs + base disk (rebuilt when the guest sources change) -------------------------------------
stamp=$(cat "$GUEST/init" "$GUEST/rc" "$GUEST/agent" "$KDIR/version" "$0" | sha256sum | cut -c1-16)
if [ -s "$DIR/initramfs.cpio.gz" ] && [ -s "$DIR/base-$stamp.qcow2" ] && [ -L "$DIR/base.qcow2" ] && [ "$(cat "$DIR/version" 2>/dev/null)" = "$stamp" ]; then
  say "initramfs and base disk up to date ($stamp)"
else
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  # initramfs: busybox, modules, /init
  ir=$tmp/initramfs
  mkdir -p "$ir"/{bin,dev,proc,sys,newroot,lib/modules,k3}
  cp "$BB" "$ir/bin/busybox"
  ln -s busybox "$ir/bin/sh"
  cp "$KDIR"/modules/*.ko "$ir/lib/modules/"
  install -m 755 "$GUEST/init" "$ir/init"
  install -m 755 "$GUEST/rc" "$ir/k3/rc"
  install -m 755 "$GUEST/agent" "$ir/k3/agent"
  (cd "$ir" && find . | cpio -o -H newc --quiet | gzip -9) > "$DIR/initramfs.cpio.gz.tmp"
  mv "$DIR/initramfs.cpio.gz.tmp" "$DIR/initramfs.cpio.gz"
  say "initramfs -> $DIR/initramfs.cpio.gz ($(du -h "$DIR/initramfs.cpio.gz" | cut -f1))"
  # root disk: ext4 populated from a directory (mkfs.ext4 -d), converted to a sparse qcow2
  rd=$tmp/root
  mkdir -p "$rd"/{bin,sbin,usr/bin,usr/sbin,etc,root,tmp,proc,sys,dev,run,home,var/log,mnt,k3}
  chmod 1777 "$rd/tmp"; chmod 700 "$rd/root"
  cp "$BB" "$rd/bin/busybox"
  for a in $("$BB" --list-full); do
    [ -e "$rd/$a" ] || ln -s /bin/busybox "$rd/$a"
  done
  install -m 755 "$GUEST/rc" "$rd/k3/rc"
  install -m 755 "$GUEST/agent" "$rd/k3/agent"
  # Debian's busybox has no nohup applet
  [ -e "$rd/usr/bin/nohup" ] || printf '#!/bin/sh\ntrap "" HUP\nexec "$@"\n' > "$rd/usr/bin/nohup"
  chmod 755 "$rd/usr/bin/nohup"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$rd/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$rd/etc/group"
  printf '127.0.0.1 localhost\n' > "$rd/etc/hosts"
  echo sandbox > "$rd/etc/hostname"
  printf '::sysinit:/k3/rc\n::respawn:/k3/agent\n::ctrlaltdel:/bin/umount -a -r\n::shutdown:/bin/umount -a -r\n' > "$rd/etc/inittab"
  truncate -s "${DISK_MB}M" "$tmp/base.raw"
  mkfs.ext4 -q -F -L k3root -E lazy_itable_init=0,lazy_journal_init=0 -m 0 -d "$rd" "$tmp/base.raw"
  qemu-img convert -q -f raw -O qcow2 "$tmp/base.raw" "$DIR/base-$stamp.qcow2.tmp"
  chmod 444 "$DIR/base-$stamp.qcow2.tmp"
  mv "$DIR/base-$stamp.qcow2.tmp" "$DIR/base-$stamp.qcow2"
  ln -sfn "base-$stamp.qcow2" "$DIR/base.qcow2.tmp" && mv -T "$DIR/base.qcow2.tmp" "$DIR/base.qcow2"
  echo "$stamp" > "$DIR/version"
  rm -rf "$tmp"; trap - EXIT
  say "base disk -> $DIR/base-$stamp.qcow2 (${DISK_MB} MiB ext4 in a $(du -h --apparent-size "$DIR/base-$stamp.qcow2" | cut -f1) qcow2)"
fi
say "done in $(( $(date +%s) - t0 )) s; artefacts in $DIR ($(du -sh "$DIR" | cut -f1))"
