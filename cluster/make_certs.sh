#!/usr/bin/env bash
# Certificates for TLS between Ray nodes (Ray's gRPC channels), made with openssl.
#
#   cluster/make_certs.sh OUT_DIR [HOST_OR_IP ...]
#
# Writes OUT_DIR/ca.crt, ca.key (the certificate authority) and node.crt, node.key (the
# certificate every Ray process presents, as server and as client: Ray's TLS is mutual). Keys are
# mode 600. The node certificate's subjectAltName holds 127.0.0.1, localhost, this machine's own
# addresses (`hostname -I`) and every HOST_OR_IP given: gRPC checks the name or address a process
# dials against it, so list every address nodes use to reach each other (the head's address, each
# silo node's address). Even a cluster started on 127.0.0.1 advertises, and dials, the machine's
# routable address instead: Ray turns 127.0.0.1 and localhost into it.
# If OUT_DIR already has ca.crt and ca.key, that CA is kept and signs the new node certificate,
# so certificates made at different times (one per machine, say) trust each other. A ca.crt
# without its ca.key (a node's copy of the CA) is refused, never replaced by a new CA.
#
# Ray reads TLS settings from the environment of `ray start` and of every driver; set the same
# four variables on every node and client (all of them once RAY_USE_TLS=1):
#   RAY_USE_TLS=1  RAY_TLS_SERVER_CERT=node.crt  RAY_TLS_SERVER_KEY=node.key  RAY_TLS_CA_CERT=ca.crt
# The script prints those lines, with absolute paths, for `eval` or a node's environment file.
# Copy ca.key nowhere: only the machine that signs node certificates needs it.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 OUT_DIR [HOST_OR_IP ...]" >&2
    exit 2
fi
if ! command -v openssl >/dev/null 2>&1; then
    echo "make_certs.sh: openssl is not on PATH" >&2
    exit 127
fi

OUT="$1"
shift
DAYS="${DAYS:-825}"
umask 077
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [[ -e "$OUT/ca.crt" && ! -e "$OUT/ca.key" ]]; then
    echo "make_certs.sh: $OUT/ca.crt has no ca.key beside it, so it cannot sign;" \
        "run this where the CA's ca.key is, or give another OUT_DIR for a new CA" >&2
    exit 1
fi

# An IPv4 address, or anything with a colon (IPv6), is an IP entry; the rest are DNS names.
ip_pattern='^([0-9]{1,3}\.){3}[0-9]{1,3}$|:'
sans="IP:127.0.0.1,DNS:localhost"
# Also this machine's own addresses: Ray replaces a node address of 127.0.0.1 or localhost by the
# machine's routable one (ray._private.services.resolve_ip_for_localhost), and dials that.
# shellcheck disable=SC2046
for name in "$@" $(hostname -I 2>/dev/null || true); do
    [[ -n "$name" ]] || continue
    if [[ "$name" =~ $ip_pattern ]]; then
        entry="IP:$name"
    else
        entry="DNS:$name"
    fi
    case ",$sans," in
        *",$entry,"*) ;;
        *) sans="$sans,$entry" ;;
    esac
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [[ -s "$OUT/ca.crt" && -s "$OUT/ca.key" ]]; then
    echo "make_certs.sh: reusing the CA in $OUT" >&2
else
    cat >"$work/ca.cnf" <<'CNF'
[req]
prompt = no
distinguished_name = dn
x509_extensions = ext
[dn]
CN = silo-pfl Ray CA
[ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
    openssl req -x509 -new -nodes -newkey rsa:2048 -sha256 -days "$DAYS" \
        -config "$work/ca.cnf" -keyout "$OUT/ca.key" -out "$OUT/ca.crt" 2>"$work/log" \
        || { cat "$work/log" >&2; exit 1; }
fi

cat >"$work/node.cnf" <<'CNF'
[req]
prompt = no
distinguished_name = dn
[dn]
CN = silo-pfl Ray node
CNF
cat >"$work/node.ext" <<CNF
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = $sans
CNF
openssl req -new -nodes -newkey rsa:2048 -sha256 -config "$work/node.cnf" \
    -keyout "$OUT/node.key" -out "$work/node.csr" 2>"$work/log" \
    || { cat "$work/log" >&2; exit 1; }
openssl x509 -req -in "$work/node.csr" -sha256 -days "$DAYS" \
    -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -extfile "$work/node.ext" -out "$OUT/node.crt" 2>"$work/log" \
    || { cat "$work/log" >&2; exit 1; }
chmod 600 "$OUT/ca.key" "$OUT/node.key"
chmod 644 "$OUT/ca.crt" "$OUT/node.crt"
openssl verify -CAfile "$OUT/ca.crt" "$OUT/node.crt" >/dev/null

echo "make_certs.sh: $OUT/node.crt for ${sans//,/ }" >&2
echo "export RAY_USE_TLS=1"
echo "export RAY_TLS_SERVER_CERT=$OUT/node.crt"
echo "export RAY_TLS_SERVER_KEY=$OUT/node.key"
echo "export RAY_TLS_CA_CERT=$OUT/ca.crt"
