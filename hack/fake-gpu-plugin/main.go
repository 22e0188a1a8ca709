// Command fake-gpu-plugin is a kubelet device plugin for GPUs that do not exist.
//
// It lets a kind cluster allocate `nvidia.com/gpu` the way a GPU cluster does, so that the
// pods of a GPU job are scheduled and started, each container holding the GPUs Kubernetes
// gave it, on machines without GPUs (e2e/kind/README.md):
//
//   - Kubernetes' side is the real one: the plugin registers with the kubelet through the
//     v1beta1 device-plugin API, the Node's capacity and allocatable show its devices, the
//     scheduler counts them, and the kubelet's device manager chooses which devices each
//     container gets (and checkpoints that choice), so no two containers share one;
//   - a container gets what NVIDIA's device plugin and container toolkit give it: the
//     environment variable NVIDIA_VISIBLE_DEVICES with the UUIDs of its devices (the plugin's
//     default "envvar" strategy), and a device file per GPU at /dev/nvidia<index>, the node's
//     index and not renumbered (the toolkit mounts the node's /dev/nvidia<minor>: a container
//     given the node's GPUs 2 and 3 sees /dev/nvidia2 and /dev/nvidia3, which CUDA calls 0
//     and 1). Here the plugin returns those files itself as DeviceSpecs, which the kubelet
//     passes to the container runtime, since no NVIDIA runtime hook exists to add them.
//
// What it does not do: there is no driver, NVML or CUDA, and no /dev/nvidiactl or
// /dev/nvidia-uvm. The device files are character devices with /dev/null's numbers, made on
// the node at start as /dev/fake-nvidia<i> (the runtime needs a real device on the node to
// pass through: it reads its type and numbers from the node's path), so reading one gives
// nothing and writing one discards.
//
// A restarted kubelet empties its device-plugin directory and forgets every plugin, so the
// plugin watches its socket and the kubelet's, and serves and registers again when either
// is replaced.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// config says what to advertise and where the kubelet and the device files are.
type config struct {
	resource  string // extended resource name, nvidia.com/gpu as NVIDIA's plugin
	node      string // part of each device's UUID, so that UUIDs are unique in the cluster
	count     int    // devices advertised
	pluginDir string // the kubelet's device-plugin directory (its socket and ours)
	devDir    string // where the node's fake device files are made
	socket    string // our socket's name in pluginDir
}

// plugin is the DevicePlugin gRPC service.
type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	cfg     config
	devices []*pluginapi.Device
	index   map[string]int // device ID (UUID) -> index on the node
}

func newPlugin(cfg config) (*plugin, error) {
	p := &plugin{cfg: cfg, index: map[string]int{}}
	for i := 0; i < cfg.count; i++ {
		id := uuid(cfg.node, i)
		if len(id) > 63 { // the kubelet refuses longer device IDs
			return nil, fmt.Errorf("device ID %q is longer than 63 characters: pass a shorter --node", id)
		}
		p.devices = append(p.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
		p.index[id] = i
	}
	return p, nil
}

// uuid is the fake GPU's UUID: stable across restarts (the kubelet's checkpoint of which
// container holds which device names them) and unique in the cluster, with NVIDIA's "GPU-"
// prefix.
func uuid(node string, i int) string { return fmt.Sprintf("GPU-%s-%d", node, i) }

// hostPath is device i's file on the node.
func (p *plugin) hostPath(i int) string {
	return filepath.Join(p.cfg.devDir, fmt.Sprintf("fake-nvidia%d", i))
}

// makeDeviceFiles makes /dev/fake-nvidia<i> for every device: character devices with the
// numbers of /dev/null, mode 0666.
func (p *plugin) makeDeviceFiles() error {
	var null syscall.Stat_t
	if err := syscall.Stat("/dev/null", &null); err != nil {
		return fmt.Errorf("stat /dev/null: %w", err)
	}
	for i := range p.devices {
		path := p.hostPath(i)
		var st syscall.Stat_t
		if err := syscall.Stat(path, &st); err == nil {
			if st.Mode&syscall.S_IFMT == syscall.S_IFCHR && st.Rdev == null.Rdev {
				continue // made by an earlier start
			}
			if err := os.Remove(path); err != nil {
				return err
			}
		}
		if err := syscall.Mknod(path, syscall.S_IFCHR|0o666, int(null.Rdev)); err != nil {
			return fmt.Errorf("mknod %s: %w", path, err)
		}
		if err := os.Chmod(path, 0o666); err != nil { // mknod's mode is masked by the umask
			return err
		}
	}
	return nil
}

// GetDevicePluginOptions: no PreStartContainer call, no preferred allocation (the kubelet
// picks the devices; NVIDIA's plugin only prefers NVLink-connected sets there).
func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices, all healthy, and keeps the stream open: the kubelet reads
// the stream's end as the plugin's, and marks its devices unhealthy.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// Allocate answers, for each container of a pod, what the container needs to use the
// devices the kubelet chose for it: NVIDIA_VISIBLE_DEVICES and one device file per GPU.
func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		ids := append([]string(nil), c.DevicesIds...)
		for _, id := range ids {
			if _, ok := p.index[id]; !ok {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		// In the node's order, as CUDA numbers the GPUs it sees (by PCI bus).
		sort.Slice(ids, func(a, b int) bool { return p.index[ids[a]] < p.index[ids[b]] })
		r := &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(ids, ",")},
		}
		for _, id := range ids {
			i := p.index[id]
			r.Devices = append(r.Devices, &pluginapi.DeviceSpec{
				ContainerPath: fmt.Sprintf("/dev/nvidia%d", i),
				HostPath:      p.hostPath(i),
				Permissions:   "rw",
			})
		}
		log.Printf("allocate: %s", strings.Join(ids, ","))
		resp.ContainerResponses = append(resp.ContainerResponses, r)
	}
	return resp, nil
}

// serve serves the plugin on its socket and registers it with the kubelet (waiting for the
// kubelet to be up). It returns nil when ctx ends, and an error once the kubelet has
// forgotten the plugin (our socket removed, or a new kubelet socket), so that the caller
// serves and registers again.
func (p *plugin) serve(ctx context.Context) error {
	sock := filepath.Join(p.cfg.pluginDir, p.cfg.socket)
	kubeletSock := filepath.Join(p.cfg.pluginDir, filepath.Base(pluginapi.KubeletSocket))
	if err := os.MkdirAll(p.cfg.pluginDir, 0o755); err != nil {
		return err
	}
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	kubelet, err := p.register(ctx, sock, kubeletSock)
	if err != nil {
		return err
	}
	if kubelet == nil {
		return nil // ctx ended
	}
	log.Printf("registered %d %s devices (%s) with the kubelet", len(p.devices), p.cfg.resource, sock)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		if _, err := os.Stat(sock); err != nil {
			return fmt.Errorf("our socket is gone (a kubelet restart empties %s)", p.cfg.pluginDir)
		}
		if fi, err := os.Stat(kubeletSock); err != nil || !os.SameFile(fi, kubelet) {
			return errors.New("the kubelet's socket was replaced (the kubelet restarted)")
		}
	}
}

// register calls the kubelet's Registration service until it answers, and returns the
// kubelet socket it registered with (nil when ctx ended first). A kubelet that starts while
// the plugin waits removes the plugin's socket before it listens on its own; the kubelet
// then cannot call the plugin back, so the plugin must serve again first.
func (p *plugin) register(ctx context.Context, sock, kubeletSock string) (os.FileInfo, error) {
	for attempt := 0; ; attempt++ {
		if _, err := os.Stat(sock); err != nil {
			return nil, fmt.Errorf("our socket is gone before registering (a starting kubelet empties %s)", p.cfg.pluginDir)
		}
		fi, err := os.Stat(kubeletSock)
		if err == nil {
			err = p.registerOnce(ctx, kubeletSock)
			if err == nil {
				return fi, nil
			}
		}
		if attempt%30 == 0 {
			log.Printf("waiting for the kubelet at %s: %v", kubeletSock, err)
		}
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(time.Second):
		}
	}
}

func (p *plugin) registerOnce(ctx context.Context, kubeletSock string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	// The kubelet calls the plugin back before it answers, for up to 10 s.
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.cfg.socket,
		ResourceName: p.cfg.resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	return err
}

func main() {
	host, _ := os.Hostname() // a kind node's hostname is its Node's name
	cfg := config{socket: "rljob-fake-gpu.sock"}
	flag.IntVar(&cfg.count, "devices", 8, "number of fake GPUs to advertise (8: the common H100/H200 node)")
	flag.StringVar(&cfg.node, "node", host, "node name in the devices' UUIDs (GPU-<node>-<i>)")
	flag.StringVar(&cfg.resource, "resource", "nvidia.com/gpu", "extended resource to advertise")
	flag.StringVar(&cfg.pluginDir, "plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	flag.StringVar(&cfg.devDir, "dev-dir", "/dev", "where to make the fake device files (fake-nvidia<i>)")
	flag.Parse()
	log.SetFlags(0)
	if cfg.count < 1 || cfg.node == "" {
		log.Fatal("--devices must be at least 1 and --node not empty")
	}
	p, err := newPlugin(cfg)
	if err != nil {
		log.Fatal(err)
	}
	if err := p.makeDeviceFiles(); err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	for ctx.Err() == nil {
		if err := p.serve(ctx); err != nil {
			log.Printf("%v: serving and registering again", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}
