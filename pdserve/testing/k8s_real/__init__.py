"""A real control plane for tests and benches: etcd, kube-apiserver and
kube-controller-manager on loopback (control_plane), fake nodes and kubelet (fake_kubelet),
and the chart installed with the real helm plus the operator under its ServiceAccount
(cluster). The binaries come from scripts/build_k8s.py."""
