module rljob.local/fake-gpu-plugin

go 1.24.0

require (
	google.golang.org/grpc v1.72.1
	k8s.io/kubelet v0.34.2
)

require (
	golang.org/x/net v0.38.0 // indirect
	golang.org/x/sys v0.31.0 // indirect
	golang.org/x/text v0.23.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250303144028-a0af3efb3deb // indirect
	google.golang.org/protobuf v1.36.5 // indirect
)
