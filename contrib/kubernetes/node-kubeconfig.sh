#!/bin/sh
# Write the kubeconfig tft-bridge node reads on every host, from the token Secret of
# contrib/kubernetes/rbac.yaml. Run where kubectl reaches the cluster as an admin:
#
#   sh node-kubeconfig.sh https://API-SERVER:6443 > node-kubeconfig
#   # then on each node:
#   install -m 0600 -o root node-kubeconfig /etc/tft-bridge/node-kubeconfig
#   # and enable LoadCredential=kubeconfig:/etc/tft-bridge/node-kubeconfig in the unit
#   # (systemctl edit tft-bridge-node); node.toml's kubernetes.kubeconfig points at
#   # /run/credentials/tft-bridge-node.service/kubeconfig.
set -eu
server=${1:?usage: node-kubeconfig.sh https://API-SERVER:6443}
ns=tft-bridge
secret=tft-bridge-node-token
token=$(kubectl -n "$ns" get secret "$secret" -o jsonpath='{.data.token}' | base64 -d)
ca=$(kubectl -n "$ns" get secret "$secret" -o jsonpath='{.data.ca\.crt}')
cat <<KUBECONFIG
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
