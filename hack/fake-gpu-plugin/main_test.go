package main

// The plugin against a stand-in kubelet Registration service: it registers (also when the
// kubelet removed its socket while starting), lists its devices, allocates per container as
// NVIDIA's plugin does, and registers again when the kubelet empties its directory. Run by hack/fake-gpu-plugin/build before each build.

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	dir      string
	requests chan *pluginapi.RegisterRequest
}

// Register calls the plugin back before it answers, as the kubelet does.
func (k *fakeKubelet) Register(ctx context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.dir, r.Endpoint),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := pluginapi.NewDevicePluginClient(conn).GetDevicePluginOptions(ctx, &pluginapi.Empty{}); err != nil {
		return nil, err
	}
	k.requests <- r
	return &pluginapi.Empty{}, nil
}

func nextRegistration(t *testing.T, k *fakeKubelet) *pluginapi.RegisterRequest {
	t.Helper()
	select {
	case r := <-k.requests:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("the plugin did not register within 10 s")
		return nil
	}
}

func TestPlugin(t *testing.T) {
	dir := t.TempDir()
	cfg := config{resource: "nvidia.com/gpu", node: "n1", count: 4, pluginDir: dir, devDir: dir,
		socket: "fake.sock"}
	p, err := newPlugin(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := p.makeDeviceFiles(); err != nil {
			t.Fatal(err)
		}
		if err := p.makeDeviceFiles(); err != nil { // a second start keeps them
			t.Fatal(err)
		}
		fi, err := os.Stat(filepath.Join(dir, "fake-nvidia3"))
		if err != nil || fi.Mode()&os.ModeCharDevice == 0 || fi.Mode().Perm() != 0o666 {
			t.Fatalf("fake-nvidia3: %v %v", fi, err)
		}
	}

	// The plugin starts before the kubelet, which removes the plugin's socket as it starts.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if err := p.serve(ctx); err != nil {
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()
	defer func() { cancel(); <-done }()
	sock := filepath.Join(dir, "fake.sock")
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the plugin did not serve within 10 s")
		}
	}
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	kubelet := &fakeKubelet{dir: dir, requests: make(chan *pluginapi.RegisterRequest, 4)}
	lis, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(srv, kubelet)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	r := nextRegistration(t, kubelet)
	if r.Version != pluginapi.Version || r.Endpoint != "fake.sock" || r.ResourceName != "nvidia.com/gpu" {
		t.Fatalf("registration %v", r)
	}

	conn, err := grpc.NewClient("unix://"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := pluginapi.NewDevicePluginClient(conn)
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	stream, err := client.ListAndWatch(cctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Devices) != 4 || list.Devices[2].ID != "GPU-n1-2" || list.Devices[2].Health != pluginapi.Healthy {
		t.Fatalf("devices %v", list.Devices)
	}

	resp, err := client.Allocate(cctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: []string{"GPU-n1-3", "GPU-n1-1"}},
		{DevicesIds: []string{"GPU-n1-0"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	first := resp.ContainerResponses[0]
	if got := first.Envs["NVIDIA_VISIBLE_DEVICES"]; got != "GPU-n1-1,GPU-n1-3" {
		t.Fatalf("NVIDIA_VISIBLE_DEVICES=%q", got)
	}
	if len(first.Devices) != 2 || first.Devices[1].ContainerPath != "/dev/nvidia3" ||
		first.Devices[1].HostPath != filepath.Join(dir, "fake-nvidia3") || first.Devices[1].Permissions != "rw" {
		t.Fatalf("devices %v", first.Devices)
	}
	if got := resp.ContainerResponses[1].Envs["NVIDIA_VISIBLE_DEVICES"]; got != "GPU-n1-0" {
		t.Fatalf("second container NVIDIA_VISIBLE_DEVICES=%q", got)
	}
	if _, err := client.Allocate(cctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: []string{"GPU-n2-0"}},
	}}); err == nil {
		t.Fatal("an unknown device was allocated")
	}

	// A restarted kubelet removes the plugins' sockets: the plugin registers again.
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	nextRegistration(t, kubelet)
}
