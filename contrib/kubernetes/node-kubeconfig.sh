#!/bin/sh
# Write the kubeconfig tft-bridge node reads on every host, from the token Secret of
# contrib/kubernetes/rbac.yaml. Run where kubectl reaches the cluster as an admin:
#
#   sh node-kubeconfig.sh https://API-SERVER:6443 node-kubeconfig
#   # then on each node:
#   install -m 0600 -o root node-kubeconfig /etc/tft-bridge/node-kubeconfig
#   # and enable LoadCredential=kubeconfig:/etc/tft-bridge/node-kubeconfig in the unit
#   # (systemctl edit tft-bridge-node; systemd >= 247, docs/node-service.md has the
#   # fallback for older ones); node.toml's kubernetes.kubeconfig points at
#   # /run/credentials/tft-bridge-node.service/kubeconfig.
#
# Right after `kubectl apply -f rbac.yaml` the Secret exists but is empty until the
# cluster's token controller fills it (seconds): this script then writes nothing and
# exits 1, saying what to wait for (with an output file named, none is created: a
# `> file` redirection would leave an empty one behind). Exit 2: bad usage.
set -eu
server=${1:-}
case $server in
    https://*|http://*) ;;
    *) echo "usage: node-kubeconfig.sh https://API-SERVER:6443 [OUTPUT-FILE]" >&2; exit 2 ;;
esac
output=${2:-}
ns=tft-bridge
secret=tft-bridge-node-token
if ! data=$(kubectl -n "$ns" get secret "$secret" -o jsonpath='{.data.token}{" "}{.data.ca\.crt}'); then
    echo "node-kubeconfig.sh: cannot read the Secret $ns/$secret: kubectl apply -f contrib/kubernetes/rbac.yaml first" >&2
    exit 1
fi
token64=${data%% *}
ca=${data#* }
[ "$ca" = "$data" ] && ca=""
if [ -z "$token64" ] || [ -z "$ca" ]; then
    missing=""
    [ -z "$token64" ] && missing="token"
    [ -z "$ca" ] && missing="${missing:+$missing and }ca.crt"
    echo "node-kubeconfig.sh: the Secret $ns/$secret has no $missing yet: the token controller fills it a few" \
         "seconds after it is created. Wait until" \
         "\`kubectl -n $ns get secret $secret -o jsonpath='{.data.token}'\` prints something, then run this again." \
         "Nothing was written." >&2
    exit 1
fi
token=$(printf '%s' "$token64" | base64 -d)
if [ -z "$token" ]; then
    echo "node-kubeconfig.sh: the Secret's token decodes to nothing; nothing was written" >&2
    exit 1
fi
write() {
    if [ -z "$output" ]; then cat; return; fi
    (umask 077 && cat >"$output.tmp") && mv -f "$output.tmp" "$output"
    echo "node-kubeconfig.sh: wrote $output" >&2
}
write <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
  - name: cluster
    cluster:
      server: $server
      certificate-authority-data: $ca
users:
  - name: tft-bridge-node
    user:
      token: $token
contexts:
  - name: tft-bridge-node
    context:
      cluster: cluster
      user: tft-bridge-node
current-context: tft-bridge-node
KUBECONFIG
